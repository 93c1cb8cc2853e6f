"""KV transfer, scheduler role (seed ``004``; vLLM's ``KVConnectorBase_V1`` scheduler side).

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

import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

from pagellm.core.scheduler_output import KVConnectorMetadata, KVConnectorOutput
from pagellm.sequence import Sequence

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
    requests_loaded: int = 0


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
                        block_hash = bytes.fromhex(f.name[: -len(FILE_SUFFIX)])
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
        for name in output.bad_files:  # gone, damaged or foreign: never asked for again
            self.index.drop(bytes.fromhex(os.path.basename(name)[: -len(FILE_SUFFIX)]))
        for name in output.failed_saves:
            self.index.drop(bytes.fromhex(os.path.basename(name)[: -len(FILE_SUFFIX)]))
