"""KV transfer, worker role (vLLM's ``KVConnectorBase_V1`` worker side): moves the blocks the
step's ``KVConnectorMetadata`` names between this worker's cache and the connector's store.

A block travels as one frame: a header (magic, format version, the engine fingerprint, the block
hash, payload length, CRC-32 of the payload) and every layer's K and V of the block, contiguous.
Whoever receives a frame checks all of it: a block from another model or numerics (another
fingerprint), of another hash, short or corrupt is reported and never copied in.

``DiskConnectorWorker`` keeps one file per block: every layer's K and V of the block, contiguous,
behind a header (magic, format version, the engine fingerprint, the block hash, payload length,
CRC-32 of the payload). Loads run before the forward pass and read synchronously (a block that
is missing, short, corrupt or foreign is reported, never copied in); saves copy the step's new
full blocks out of the cache right after the pass (so later steps may reuse the blocks) and a
writer thread puts them on disk as ``tmp`` + ``rename`` (a reader never sees half a file). A block
still in the writer's queue is loaded from memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from typing import Any

import torch

from pagellm.core.scheduler_output import KVConnectorMetadata, KVConnectorOutput, block_hash_of
from pagellm.worker.cache_engine import CacheEngine

logger = logging.getLogger(__name__)

MAGIC = b"PAGELLMKV\x01"
_HEADER = struct.Struct("<10s32s32sQI")  # magic+version, fingerprint, block hash, payload bytes, crc32


class KVConnectorWorker:
    """What every connector's worker side does with blocks: frames out of the cache after the
    pass, checked frames into it before the pass (``fingerprint``: 32 bytes naming model,
    numerics and K/V layout)."""

    def __init__(self, fingerprint: bytes, cache: CacheEngine) -> None:
        self.fingerprint = fingerprint
        self.cache = cache
        spec = cache.spec
        self.payload_bytes = spec.block_bytes
        self._block_shape = (spec.num_layers, 2, spec.block_size * spec.num_kv_heads * spec.cache_head_dim)

    def start_load_kv(self, meta: KVConnectorMetadata, out: KVConnectorOutput) -> None:
        """Fill each loading request's blocks, in order, stopping at its first bad block."""
        if not meta.loads:
            return
        t0 = time.perf_counter()
        blocks = CacheEngine._blocks(self.cache.kv, self.cache.spec.block_size)
        for request_id, items in meta.loads.items():
            n = 0
            for block_id, name in items:
                payload = self._payload(meta, name)
                if payload is None:
                    out.bad_files.append(name)
                    break
                src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.cache.spec.dtype)
                blocks[:, :, block_id].copy_(src.view(self._block_shape))
                out.bytes_loaded += len(payload)
                n += 1
            out.loaded[request_id] = n
        out.load_seconds += time.perf_counter() - t0

    def _payload(self, meta: KVConnectorMetadata, name: str) -> bytes | None:
        data = meta.payloads.get(name)
        return None if data is None else self._unpack(data, name)

    def _frames(self, items: list[tuple[int, str]]) -> list[bytes]:
        """The blocks ``(block id, name)`` copied out of the cache, framed."""
        blocks = CacheEngine._blocks(self.cache.kv, self.cache.spec.block_size)
        ids = torch.tensor([b for b, _ in items], dtype=torch.long, device=self.cache.kv.device)
        raw = blocks.index_select(2, ids).permute(2, 0, 1, 3).contiguous().cpu().view(torch.uint8).numpy()
        out = []
        for i, (_, name) in enumerate(items):
            payload = raw[i].tobytes()
            out.append(_HEADER.pack(MAGIC, self.fingerprint, block_hash_of(name), len(payload), zlib.crc32(payload))
                       + payload)
        return out

    def _unpack(self, data: bytes, name: str) -> bytes | None:
        """The payload of a frame if it is whole, uncorrupted and of this engine's kind."""
        why = self._defect(data, name)
        if why is not None:
            self._bad(name, why)
            return None
        return data[_HEADER.size:]

    def _defect(self, data: bytes, name: str) -> str | None:
        """What is wrong with a frame (``None``: nothing)."""
        if len(data) < _HEADER.size:
            return "truncated header"
        magic, fingerprint, block_hash, size, crc = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if magic != MAGIC or fingerprint != self.fingerprint or block_hash != block_hash_of(name):
            return "foreign (another format, model, numerics or block)"
        if size != self.payload_bytes or len(payload) != size:
            return f"{len(payload)} payload bytes, expected {self.payload_bytes}"
        if zlib.crc32(payload) != crc:
            return "checksum mismatch"
        return None

    def _bad(self, name: str, why: str) -> None:
        logger.warning("KV block %s ignored: %s", name, why)

    def save_kv(self, meta: KVConnectorMetadata, out: KVConnectorOutput) -> None:
        """After the pass: copy out what the metadata asks to keep or send, and queue it for the
        connector's thread (``_queue``, ``_thread``: set up by ``_start_thread``)."""

    def _start_thread(self, target: Any, name: str) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def _serve_queue(self, handle: Any) -> None:
        """The thread's loop: ``handle`` each queued item until the ``None`` of ``shutdown``."""
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                handle(item)
            finally:
                self._queue.task_done()

    def wait_for_save(self) -> None:
        """Block until every queued save, send or delete is done (shutdown, tests)."""
        self._queue.join()

    def shutdown(self) -> None:
        """Finish queued work and stop the thread."""
        self.wait_for_save()
        self._queue.put(None)
        self._thread.join(timeout=10)


class DiskConnectorWorker(KVConnectorWorker):
    """The worker side of ``DiskConnector``; ``root`` is the fingerprint's directory."""

    def __init__(self, root: str, fingerprint: bytes, cache: CacheEngine) -> None:
        super().__init__(fingerprint, cache)
        self.root = root
        os.makedirs(root, exist_ok=True)
        self._pending: dict[str, bytes] = {}  # name -> file bytes not yet on disk
        self._lock = threading.Lock()
        self._failed_saves: list[str] = []
        self._start_thread(lambda: self._serve_queue(self._write), "pagellm-kv-writer")

    def save_kv(self, meta: KVConnectorMetadata, out: KVConnectorOutput) -> None:
        """Copy the step's saved blocks out of the cache (now: the blocks may be reused by the
        next step) and queue them for the writer; queue the deletes."""
        for name in meta.deletes:
            self._queue.put((name, None))
        if meta.saves:
            for (_, name), data in zip(meta.saves, self._frames(meta.saves), strict=True):
                with self._lock:
                    self._pending[name] = data
                self._queue.put((name, data))
                out.blocks_saved += 1
                out.bytes_saved += len(data) - _HEADER.size
        with self._lock:
            out.failed_saves.extend(self._failed_saves)
            self._failed_saves.clear()

    # ------------------------------------------------------------------ files
    def _payload(self, meta: KVConnectorMetadata, name: str) -> bytes | None:
        """A block's payload if its file is whole, uncorrupted and ours; else ``None``."""
        with self._lock:
            data = self._pending.get(name)
        path = os.path.join(self.root, name)
        if data is None:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                return None
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: the last to go when the next engine scans the directory
        return self._unpack(data, name)

    def _bad(self, name: str, why: str) -> None:
        path = os.path.join(self.root, name)
        logger.warning("KV block file %s ignored and removed: %s", path, why)
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _write(self, item: tuple[str, bytes | None]) -> None:
        """A block's file written (temporary + rename), or deleted (``None``)."""
        name, data = item
        path = os.path.join(self.root, name)
        if data is None:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:  # disk full, read-only: the block is simply not cached
            logger.warning("KV block %s not saved: %s", path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with self._lock:
                self._failed_saves.append(name)
        finally:
            with self._lock:
                if self._pending.get(name) is data:
                    del self._pending[name]


class TcpConnectorWorker(KVConnectorWorker):
    """The worker side of ``TcpConnector``: loads from the frames the engine received (inline in
    the metadata); sends a finished prompt's blocks to the decode engine named in its request,
    from a thread, over ZMQ PUSH sockets (one per address, reconnecting by themselves). A send
    that cannot go out within ``timeout_s`` is dropped: the decode side then recomputes."""

    def __init__(self, fingerprint: bytes, cache: CacheEngine, timeout_s: float) -> None:
        super().__init__(fingerprint, cache)
        self.timeout_s = timeout_s
        self._start_thread(self._send_loop, "pagellm-kv-sender")

    def save_kv(self, meta: KVConnectorMetadata, out: KVConnectorOutput) -> None:
        for address, transfer_id, items in meta.sends:
            tid = transfer_id.encode()
            msgs = [[b"block", tid, block_hash_of(name), frame] for (_, name), frame in zip(items, self._frames(items),
                                                                                      strict=True)] if items else []
            msgs.append([b"done", tid, str(len(items)).encode()])
            self._queue.put((address, msgs))
            out.blocks_saved += len(items)
            out.bytes_saved += len(items) * self.payload_bytes

    def _send_loop(self) -> None:
        import zmq

        ctx = zmq.Context()
        sockets: dict[str, Any] = {}

        def send(item: tuple[str, list[list[bytes]]]) -> None:
            address, msgs = item
            sock = sockets.get(address)
            if sock is None:
                sock = sockets[address] = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
                sock.setsockopt(zmq.SNDHWM, 256)
                sock.setsockopt(zmq.LINGER, int(self.timeout_s * 1000))
                sock.connect(address)
            try:
                for parts in msgs:
                    sock.send_multipart(parts, copy=False)
            except zmq.Again:
                logger.warning("KV transfer to %s timed out after %.0f s: the decode side recomputes",
                               address, self.timeout_s)

        try:
            self._serve_queue(send)
        finally:
            for sock in sockets.values():
                sock.close()
            ctx.term()
