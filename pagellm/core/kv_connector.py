"""KV transfer, scheduler role (vLLM's ``KVConnectorBase_V1`` scheduler side).

A connector finds K/V outside this engine's device pool for a request's prefix and moves blocks
between the pool and elsewhere; the scheduler stays in charge of every block:

- at first admission, ``get_num_new_matched_tokens`` says how many tokens past the local prefix
  hits the connector holds. The scheduler then allocates blocks for them and the request waits
  (``WAITING_FOR_REMOTE_KVS``) without taking any of the step's token budget;
- ``update_state_after_alloc`` records which blocks to fill; ``build_connector_meta`` hands the
  step's loads, saves and deletes to the worker inside the ``SchedulerOutput``;
- the worker's ``KVConnectorOutput`` comes back with, per loading request, how many of its blocks
  arrived intact (a prefix). The scheduler registers those in the prefix cache, frees the
  request's blocks (cached, so they stay until evicted) and puts it back at the head of the
  waiting queue, where ordinary admission finds them as local hits. So a failed or partial load
  costs recompute and nothing else, and no path holds a block past the step that loaded it.
(vLLM's ``request_finished``, which lets a connector keep a finished request's blocks for a
hand-off to another engine, comes with such a connector; none here needs it.)

Pure Python (layer 2): no torch, no files read here beyond a directory listing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagellm.config import KVTransferConfig
from pagellm.core.scheduler_output import KVConnectorMetadata, KVConnectorOutput, block_hash_of
from pagellm.sequence import Sequence, SequenceGroup

logger = logging.getLogger(__name__)

# What a request may carry in ``kv_transfer_params`` (vLLM's field; the proxy fills it).
KV_TRANSFER_PARAMS = {"do_remote_decode", "do_remote_prefill", "transfer_id", "remote_host", "remote_port"}


def check_kv_transfer_params(params: Any) -> dict[str, Any]:
    """``params`` validated (a ``ValueError`` naming the bad field)."""
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    unknown = set(params) - KV_TRANSFER_PARAMS
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown field(s) {sorted(unknown)}; known: {sorted(KV_TRANSFER_PARAMS)}")
    if (params.get("do_remote_decode") or params.get("do_remote_prefill")) and \
            not isinstance(params.get("transfer_id"), str):
        raise ValueError("kv_transfer_params.transfer_id must be a string")
    if params.get("do_remote_decode") and (not isinstance(params.get("remote_host"), str)
                                           or not isinstance(params.get("remote_port"), int)):
        raise ValueError("kv_transfer_params with do_remote_decode needs remote_host (str) and remote_port (int)")
    return params


FILE_SUFFIX = ".kvblock"


@dataclass(slots=True)
class KVTransferStats:
    """Counters since start (exported as metrics)."""

    blocks_saved: int = 0
    blocks_loaded: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0  # blocks that were asked for and did not arrive intact


class KVConnectorScheduler(ABC):
    """The scheduler's side of a connector (see the module docstring for the protocol)."""

    def __init__(self) -> None:
        self.stats = KVTransferStats()

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Tokens after ``num_computed_tokens`` (a whole number of blocks) whose K/V this
        connector can load, never reaching the last known token (its logits are needed)."""

    @abstractmethod
    def update_state_after_alloc(self, request_id: str, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """The blocks allocated for a match: fill ``block_ids[i]`` with the K/V of ``block_hashes[i]``."""

    def request_save(self, block_id: int, block_hash: bytes) -> None:  # noqa: B027 (optional hook)
        """A full block this step computes (with its chained hash); save it if wanted."""

    def prompt_done(self, group: SequenceGroup, block_ids: list[int], block_hashes: list[bytes]) -> None:  # noqa: B027
        """``group``'s prompt is computed by the end of this step; these are its full blocks."""

    def waiting_for_remote(self, group: SequenceGroup) -> bool:
        """``True`` while ``group`` must wait for K/V another engine is sending (it keeps its place
        in the queue and holds no blocks); ``False`` once they are here or will not come."""
        return False

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """The step's transfers for the worker (``None``: nothing to do); clears them here."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report on a step's transfers (counters; a connector may drop what failed)."""
        self.stats.blocks_saved += output.blocks_saved
        self.stats.bytes_saved += output.bytes_saved
        self.stats.bytes_loaded += output.bytes_loaded
        self.stats.load_seconds += output.load_seconds


def block_file_name(block_hash: bytes) -> str:
    """A block's file under the connector's directory: fanned out by the hash's first byte."""
    h = block_hash.hex()
    return os.path.join(h[:2], h + FILE_SUFFIX)


@dataclass(slots=True)
class _Index:
    """The blocks on disk, least recently used first, with their sizes."""

    files: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    total_bytes: int = 0

    def add(self, block_hash: bytes, size: int) -> None:
        self.total_bytes += size - self.files.pop(block_hash, 0)
        self.files[block_hash] = size

    def drop(self, block_hash: bytes) -> None:
        self.total_bytes -= self.files.pop(block_hash, 0)


class DiskConnectorScheduler(KVConnectorScheduler):
    """A persistent prefix cache: full blocks saved under ``root`` by their chained block hash
    (``root`` already names the fingerprint of model, numerics, K/V dtype and block size; adapter
    and cache salt are in the hash), loaded by any later engine with the same fingerprint.

    The index of what is on disk lives here, read once from the directory (oldest file first) and
    kept in LRU order by saves and loads; past ``max_bytes`` the least recently used blocks are
    deleted (the worker removes the files). ``max_bytes=0`` saves nothing. A block whose file the
    worker finds missing, truncated, corrupt or foreign is reported and dropped from the index.
    """

    def __init__(self, root: str, block_size: int, block_bytes: int, max_bytes: int, save: bool = True,
                 load: bool = True) -> None:
        super().__init__()
        self.root = root
        self.block_size = block_size
        self.block_bytes = block_bytes  # a saved block's payload (its file adds a small header)
        self.max_bytes = max_bytes
        self.save, self.load = save, load
        self.index = _Index()
        self._loads: dict[str, list[tuple[int, str]]] = {}
        self._saves: dict[str, int] = {}  # name -> block id, this step's
        self._deletes: list[str] = []
        self._scan()

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        if os.path.isdir(self.root):
            for sub in os.scandir(self.root):
                if not sub.is_dir():
                    continue
                for f in os.scandir(sub.path):
                    if not f.name.endswith(FILE_SUFFIX):
                        continue  # temporaries of an interrupted save, strangers
                    try:
                        st = f.stat()
                        block_hash = block_hash_of(f.name)
                    except (OSError, ValueError):
                        continue
                    found.append((st.st_mtime, block_hash, st.st_size))
        for _, block_hash, size in sorted(found):
            self.index.add(block_hash, size)

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        if not self.load:
            return 0
        bs = self.block_size
        first, limit = num_computed_tokens // bs, (seq.num_tokens - 1) // bs
        n = 0
        for h in seq.block_hashes[first:limit]:
            if h not in self.index.files:
                break
            n += 1
        return n * bs

    def update_state_after_alloc(self, request_id: str, block_ids: list[int], block_hashes: list[bytes]) -> None:
        for h in block_hashes:
            self.index.files.move_to_end(h)  # used: the last to be evicted
        self._loads[request_id] = [(b, block_file_name(h)) for b, h in zip(block_ids, block_hashes, strict=True)]

    def request_save(self, block_id: int, block_hash: bytes) -> None:
        size = self.block_bytes
        if not self.save or block_hash in self.index.files or size > self.max_bytes:
            return
        while self.index.files and self.index.total_bytes + size > self.max_bytes:
            victim, victim_size = self.index.files.popitem(last=False)
            self.index.total_bytes -= victim_size
            name = block_file_name(victim)
            if self._saves.pop(name, None) is None:  # (one saved this very step is just not written)
                self._deletes.append(name)
        self.index.add(block_hash, size)
        self._saves[block_file_name(block_hash)] = block_id

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if not (self._loads or self._saves or self._deletes):
            return None
        meta = KVConnectorMetadata(loads=self._loads, saves=[(b, name) for name, b in self._saves.items()],
                                   deletes=self._deletes)
        self._loads, self._saves, self._deletes = {}, {}, []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        for name in output.bad_files + output.failed_saves:  # gone, damaged, foreign or unwritten
            self.index.drop(block_hash_of(name))


class ReceivedBlocks:
    """Blocks other engines pushed to this one (``engine/kv_receiver.py`` puts them, from its
    thread), kept by block hash in LRU order under a byte cap, and which transfers are complete."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._done: OrderedDict[str, int] = OrderedDict()  # transfer id -> blocks announced

    def put(self, block_hash: bytes, data: bytes) -> None:
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            self._bytes += len(data) - (len(old) if old is not None else 0)
            self._blocks[block_hash] = data
            while self._bytes > self.max_bytes and self._blocks:
                _, victim = self._blocks.popitem(last=False)
                self._bytes -= len(victim)

    def finish(self, transfer_id: str, num_blocks: int) -> None:
        with self._lock:
            self._done[transfer_id] = num_blocks
            while len(self._done) > 100_000:
                self._done.popitem(last=False)

    def is_done(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._done

    def get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            data = self._blocks.get(block_hash)
            if data is not None:
                self._blocks.move_to_end(block_hash)
            return data

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def drop(self, block_hash: bytes) -> None:
        with self._lock:
            data = self._blocks.pop(block_hash, None)
            if data is not None:
                self._bytes -= len(data)


class TcpConnectorScheduler(KVConnectorScheduler):
    """Disaggregated prefill/decode over TCP (docs/kv_transfer.md).

    Producer (a prefill engine): a request with ``kv_transfer_params.do_remote_decode`` has every
    full block of its prompt pushed, when its prompt is computed, to the decode engine at
    ``remote_host:remote_port`` (the worker copies them out after that step and sends them from a
    thread), then a "done" for its ``transfer_id``. Its blocks are free as soon as the request
    ends: nothing waits on the decode side.

    Consumer (a decode engine): blocks pushed to it land in ``received``; a request with
    ``do_remote_prefill`` waits in the queue (holding no blocks, keeping its place) until its
    transfer is done or ``timeout_s`` has passed, then loads whatever matches its prefix, like the
    disk connector, and computes the rest.
    """

    def __init__(self, block_size: int, received: ReceivedBlocks | None, timeout_s: float,
                 clock: Any = time.monotonic) -> None:
        super().__init__()
        self.block_size = block_size
        self.received = received
        self.timeout_s = timeout_s
        self.clock = clock
        self.num_timeouts = 0
        self._loads: dict[str, list[tuple[int, str]]] = {}
        self._payloads: dict[str, bytes] = {}
        self._sends: list[tuple[str, str, list[tuple[int, str]]]] = []

    def waiting_for_remote(self, group: SequenceGroup) -> bool:
        state = group.kv_transfer
        params = state.params
        if not params or not params.get("do_remote_prefill") or self.received is None or state.load_tried \
                or state.timed_out:
            return False
        if self.received.is_done(params["transfer_id"]):
            return False
        if self.clock() - group.arrival_time > self.timeout_s:
            self.num_timeouts += 1
            self.stats.load_failures += 1
            state.timed_out = True  # from now on: the blocks that came, and recompute
            return False
        return True

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        if self.received is None:
            return 0
        bs = self.block_size
        n = 0
        for h in seq.block_hashes[num_computed_tokens // bs:(seq.num_tokens - 1) // bs]:
            if h not in self.received:
                break
            n += 1
        return n * bs

    def update_state_after_alloc(self, request_id: str, block_ids: list[int], block_hashes: list[bytes]) -> None:
        assert self.received is not None
        items = []
        for b, h in zip(block_ids, block_hashes, strict=True):
            data = self.received.get(h)
            if data is None:  # evicted since the match: the rest is recomputed
                break
            name = h.hex()
            self._payloads[name] = data
            items.append((b, name))
        self._loads[request_id] = items

    def prompt_done(self, group: SequenceGroup, block_ids: list[int], block_hashes: list[bytes]) -> None:
        params = group.kv_transfer.params
        if not params or not params.get("do_remote_decode"):
            return
        dest = f"tcp://{params['remote_host']}:{params['remote_port']}"
        self._sends.append((dest, params["transfer_id"],
                            [(b, h.hex()) for b, h in zip(block_ids, block_hashes, strict=True)]))

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if not (self._loads or self._sends):
            return None
        meta = KVConnectorMetadata(loads=self._loads, payloads=self._payloads, sends=self._sends)
        self._loads, self._payloads, self._sends = {}, {}, []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        if self.received is not None:
            for name in output.bad_files:  # foreign (another model or numerics) or damaged in flight
                self.received.drop(block_hash_of(name))


def create_kv_connector(kvt: KVTransferConfig, block_size: int, kv_fingerprint: str,
                        block_bytes: int) -> KVConnectorScheduler:
    """The scheduler side of the connector ``kvt`` names (vLLM's ``KVConnectorFactory``). A
    ``TcpConnector`` that loads gets an empty ``received`` buffer for the engine's receiver."""
    if kvt.kv_connector == "DiskConnector":
        disk = DiskConnectorScheduler(kvt.store_dir(kv_fingerprint), block_size, block_bytes, kvt.max_bytes,
                                      kvt.saves, kvt.loads)
        logger.info("KV transfer: DiskConnector at %s (%s, %d blocks / %.1f MiB on disk, cap %.1f GiB)",
                    disk.root, kvt.kv_role, len(disk.index.files), disk.index.total_bytes / 2**20,
                    kvt.max_bytes / 2**30)
        return disk
    if kvt.kv_connector == "TcpConnector":
        received = ReceivedBlocks(kvt.max_bytes) if kvt.loads else None
        return TcpConnectorScheduler(block_size, received, kvt.timeout_s)
    raise ValueError(f"kv_connector {kvt.kv_connector!r} is not built")
