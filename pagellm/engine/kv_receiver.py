"""The decode engine's end of ``TcpConnector``: a thread with a ZMQ PULL socket bound to the
configured address, putting the blocks prefill engines push into ``ReceivedBlocks`` and marking
their transfers done. The frames are checked when loaded (``worker/kv_connector.py``), not here:
this thread only stores bytes."""

from __future__ import annotations

import logging
import threading

from pagellm.core.kv_connector import ReceivedBlocks

logger = logging.getLogger(__name__)


class KVReceiver:
    """Receives pushed blocks at ``tcp://host:port`` (port 0: any free port, see ``address``)."""

    def __init__(self, received: ReceivedBlocks, host: str, port: int) -> None:
        import zmq

        self.received = received
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 1024)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pagellm-kv-receiver", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def _loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                parts = self._sock.recv_multipart()
            except zmq.ZMQError:
                return
            if len(parts) == 4 and parts[0] == b"block" and len(parts[2]) == 32:
                self.received.put(bytes(parts[2]), bytes(parts[3]))
            elif len(parts) == 3 and parts[0] == b"done":
                try:
                    self.received.finish(parts[1].decode(), int(parts[2]))
                except ValueError:
                    logger.warning("KV receiver: malformed done message dropped")
            else:
                logger.warning("KV receiver: unknown message of %d parts dropped", len(parts))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
