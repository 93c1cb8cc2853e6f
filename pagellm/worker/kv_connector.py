"""KV transfer, worker role (vLLM's ``KVConnectorBase_V1`` worker side): moves the blocks the
step's ``KVConnectorMetadata`` names between this worker's cache and the connector's store.

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

import torch

from pagellm.core.scheduler_output import KVConnectorMetadata, KVConnectorOutput
from pagellm.worker.cache_engine import CacheEngine

logger = logging.getLogger(__name__)

MAGIC = b"PAGELLMKV\x01"
_HEADER = struct.Struct("<10s32s32sQI")  # magic+version, fingerprint, block hash, payload bytes, crc32


def _hash_of(name: str) -> bytes:
    return bytes.fromhex(os.path.basename(name).split(".")[0])


class DiskConnectorWorker:
    """The worker side of ``DiskConnector`` over one ``CacheEngine``; ``root`` is the
    fingerprint's directory (``fingerprint``: 32 bytes naming model, numerics and K/V layout)."""

    def __init__(self, root: str, fingerprint: bytes, cache: CacheEngine) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.cache = cache
        spec = cache.spec
        self.payload_bytes = spec.block_bytes
        self._block_shape = (spec.num_layers, 2, spec.block_size * spec.num_kv_heads * spec.head_dim)
        os.makedirs(root, exist_ok=True)
        self._pending: dict[str, bytes] = {}  # name -> file bytes not yet on disk
        self._lock = threading.Lock()
        self._failed_saves: list[str] = []
        self._queue: queue.Queue[tuple[str, bytes | None] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="pagellm-kv-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ the step
    def start_load_kv(self, meta: KVConnectorMetadata, out: KVConnectorOutput) -> None:
        """Fill each loading request's blocks, in order, stopping at its first bad block."""
        if not meta.loads:
            return
        t0 = time.perf_counter()
        blocks = CacheEngine._blocks(self.cache.kv, self.cache.spec.block_size)
        for request_id, items in meta.loads.items():
            n = 0
            for block_id, name in items:
                payload = self._read(name)
                if payload is None:
                    out.bad_files.append(name)
                    break
                src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.cache.spec.dtype)
                blocks[:, :, block_id].copy_(src.view(self._block_shape))
                out.bytes_loaded += len(payload)
                n += 1
            out.loaded[request_id] = n
        out.load_seconds += time.perf_counter() - t0

    def save_kv(self, meta: KVConnectorMetadata, out: KVConnectorOutput) -> None:
        """Copy the step's saved blocks out of the cache (now: the blocks may be reused by the
        next step) and queue them for the writer; queue the deletes."""
        for name in meta.deletes:
            self._queue.put((name, None))
        if meta.saves:
            blocks = CacheEngine._blocks(self.cache.kv, self.cache.spec.block_size)
            ids = torch.tensor([b for b, _ in meta.saves], dtype=torch.long, device=self.cache.kv.device)
            rows = blocks.index_select(2, ids).permute(2, 0, 1, 3).contiguous().cpu()
            raw = rows.view(torch.uint8).numpy()
            for i, (_, name) in enumerate(meta.saves):
                payload = raw[i].tobytes()
                data = _HEADER.pack(MAGIC, self.fingerprint, _hash_of(name), len(payload),
                                    zlib.crc32(payload)) + payload
                with self._lock:
                    self._pending[name] = data
                self._queue.put((name, data))
                out.blocks_saved += 1
                out.bytes_saved += len(payload)
        with self._lock:
            out.failed_saves.extend(self._failed_saves)
            self._failed_saves.clear()

    def wait_for_save(self) -> None:
        """Block until every queued save and delete is done (shutdown, tests)."""
        self._queue.join()

    def shutdown(self) -> None:
        self.wait_for_save()
        self._queue.put(None)
        self._writer.join(timeout=10)

    # ------------------------------------------------------------------ files
    def _read(self, name: str) -> bytes | None:
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
        if len(data) < _HEADER.size:
            return self._bad(path, "truncated header")
        magic, fingerprint, block_hash, size, crc = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if magic != MAGIC or fingerprint != self.fingerprint or block_hash != _hash_of(name):
            return self._bad(path, "foreign (another format, model, numerics or block)")
        if size != self.payload_bytes or len(payload) != size:
            return self._bad(path, f"{len(payload)} payload bytes, expected {self.payload_bytes}")
        if zlib.crc32(payload) != crc:
            return self._bad(path, "checksum mismatch")
        return payload

    def _bad(self, path: str, why: str) -> None:
        logger.warning("KV block file %s ignored and removed: %s", path, why)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                name, data = item
                path = os.path.join(self.root, name)
                if data is None:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    continue
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
            finally:
                self._queue.task_done()
