"""Block tables: which physical blocks hold each sequence's K/V.

``allocate_slots(seq, n)`` makes room for ``n`` more tokens after ``seq.num_computed_tokens``;
it returns the newly added blocks (possibly none) or ``None`` when the pool cannot supply them,
which tells the scheduler to preempt someone::

    block_table:  [b3][b8][b1]           block_size = 4
    tokens:       xxxx xxxx xx..         num_computed_tokens = 10, n = 5 -> needs cdiv(15, 4) = 4 blocks
                                         -> one new block, appended to the table

Preemption by swap moves a group's blocks to a second pool of CPU blocks (``swap_out``) and back
(``swap_in``); both return the ``(src, dst)`` block-id pairs the worker copies. A block shared
by several sequences of the group is copied once and stays shared on the other side.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagellm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagellm.mm_inputs import BlockKeys
from pagellm.sequence import Sequence
from pagellm.utils import InvariantError, cdiv

ExtraKey = str | BlockKeys | None  # what block hashes include besides tokens (SequenceGroup.hash_key)


class AllocStatus(enum.Enum):
    """Answer to "can these blocks be placed?": now, after others free some, or never."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


@dataclass(slots=True)
class SlotRequest:
    """Room asked for one sequence: ``num_new_tokens`` after ``num_computed_tokens`` (which counts
    ``computed_blocks``, a new sequence's prefix-cache hit). A plan the scheduler can weigh
    (``KVCacheManager.num_new_blocks``) before anything is allocated or changed."""

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    computed_blocks: list[KVCacheBlock] = field(default_factory=list)


def _unique(tables: list[list[KVCacheBlock]]) -> list[KVCacheBlock]:
    seen: dict[int, KVCacheBlock] = {}
    for table in tables:
        for b in table:
            seen.setdefault(b.block_id, b)
    return list(seen.values())


class KVCacheManager:
    """Maps sequences to their blocks in one ``BlockPool``; finds and records cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_cpu_blocks: int = 0,
                 watermark: float = 0.0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        # Off: nothing is ever hashed into the pool, so nothing is ever found there either.
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[KVCacheBlock]] = {}
        # The CPU swap pool: plain blocks, never hashed (nothing is looked up there).
        self.cpu_pool = BlockPool(num_cpu_blocks)
        self.cpu_block_tables: dict[int, list[KVCacheBlock]] = {}
        # Admissions and swap-ins leave this many device blocks free for running sequences to grow.
        self.watermark_blocks = int(watermark * num_blocks)
        # Per sequence: how many leading blocks are already recorded in the prefix cache.
        self._num_cached_blocks: dict[int, int] = {}
        self._copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _update_block_hashes(self, seq: Sequence, extra_key: ExtraKey) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its known tokens (``extra_key``:
        block 0's, or each block's: ``BlockKeys``)."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            key = extra_key.key(i, bs) if isinstance(extra_key, BlockKeys) else extra_key if i == 0 else None
            hashes.append(hash_block_tokens(parent, seq.token_ids_range(i * bs, (i + 1) * bs), key))

    def block_hashes(self, seq: Sequence, extra_key: ExtraKey = None) -> list[bytes]:
        """``seq``'s chained block hashes, one per full block of its known tokens."""
        self._update_block_hashes(seq, extra_key)
        return seq.block_hashes

    def get_computed_blocks(self, seq: Sequence, extra_key: ExtraKey = None) -> list[KVCacheBlock]:
        """The longest run of cached blocks that prefixes ``seq`` (not yet touched).

        Capped at ``(num_tokens - 1) // block_size`` blocks: the last known token is always
        recomputed, because its logits produce the next token::

            tokens  |....|....|....|..       cached: [b4][b9][b2]  -> at most 3 blocks since
                                              num_tokens = 14 -> (14 - 1) // 4 = 3
        """
        if not self.enable_caching:
            return []
        self._update_block_hashes(seq, extra_key)
        out: list[KVCacheBlock] = []
        for h in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            out.append(block)
        return out

    def cache_full_blocks(self, seq: Sequence, extra_key: ExtraKey = None) -> None:
        """Record the hashes of ``seq``'s blocks that are full and fully computed."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        self._update_block_hashes(seq, extra_key)
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes), len(table))
        start = self._num_cached_blocks.get(seq.seq_id, 0)
        for i in range(start, n_full):
            self.block_pool.cache_block(table[i], seq.block_hashes[i])
        self._num_cached_blocks[seq.seq_id] = max(start, n_full)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ allocation
    def num_new_blocks(self, requests: Iterable[SlotRequest],
                       tables: dict[int, list[KVCacheBlock]] | None = None) -> int:
        """Free device blocks that giving every request its slots would take: the one place that
        counts blocks. ``tables``: where each sequence's blocks are now (the device block tables
        by default; the CPU ones for a swap-in, whose blocks must then come back too)::

            per request:  cdiv(num_computed_tokens + num_new_tokens, block_size) - len(table) - len(hits)
                        + 1 if the block the next token goes into is shared (copy-on-write)
            once:         + cached hits nobody holds (touching them takes them off the free list)

        A cached block several requests hit (sibling forks) is reclaimed once.
        """
        tables = self.block_tables if tables is None else tables
        need = 0
        reclaimed: set[int] = set()
        for r in requests:
            table = tables.get(r.seq.seq_id, [])
            have = len(table) + len(r.computed_blocks)
            need += max(0, self.num_blocks_for(r.num_computed_tokens + r.num_new_tokens) - have)
            need += self._needs_cow(r.num_computed_tokens, table)
            reclaimed.update(b.block_id for b in r.computed_blocks if b.ref_cnt == 0)
        return need + len(reclaimed)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Grow ``seq``'s block table to hold ``num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` (a new sequence's prefix-cache hit, from ``get_computed_blocks``) start
        the table: they are touched, and ``seq.num_computed_tokens`` must already count them.
        A shared, partly filled block about to be written is first replaced by a private copy
        (copy-on-write; the copy is queued for ``take_copies``).
        Returns the newly allocated blocks, or ``None`` (and changes nothing) when the pool
        cannot supply them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        computed_blocks = computed_blocks or []
        table = self.block_tables.get(seq.seq_id, [])
        if computed_blocks and table:
            raise ValueError(f"prefix hits only start a new block table; sequence {seq.seq_id} has one")
        request = SlotRequest(seq, seq.num_computed_tokens, num_new_tokens, computed_blocks)
        if self.num_new_blocks([request]) > self.block_pool.num_free_blocks:
            return None
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
            table = list(computed_blocks)
        self.block_tables[seq.seq_id] = table
        new: list[KVCacheBlock] = []
        if self._needs_cow(seq.num_computed_tokens, table):
            i = seq.num_computed_tokens // self.block_size
            old = table[i]
            table[i] = self.block_pool.get_new_blocks(1)[0]
            self._copies.append((old.block_id, table[i].block_id))
            self.block_pool.free_blocks([old])  # still held by its other owners
            new.append(table[i])
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(table)
        if need > 0:
            added = self.block_pool.get_new_blocks(need)
            table.extend(added)
            new.extend(added)
        return new

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Give back the blocks past the first ``num_tokens`` slots (speculative decoding: blocks
        that held only rejected drafts). Returns how many went back."""
        table = self.block_tables.get(seq.seq_id)
        keep = self.num_blocks_for(num_tokens)
        if not table or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        self.block_pool.free_blocks(reversed(tail))
        if self._num_cached_blocks.get(seq.seq_id, 0) > keep:
            self._num_cached_blocks[seq.seq_id] = keep
        return len(tail)

    def _needs_cow(self, num_computed_tokens: int, table: list[KVCacheBlock]) -> bool:
        """The block the next token goes into exists and is shared: it must be copied first."""
        i = num_computed_tokens // self.block_size
        return i < len(table) and table[i].ref_cnt > 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (one more reference each)."""
        table = self.block_tables.get(parent.seq_id, [])
        self.block_pool.touch(table)
        self.block_tables[child.seq_id] = list(table)
        self._num_cached_blocks[child.seq_id] = self._num_cached_blocks.get(parent.seq_id, 0)

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies ``(src, dst)`` queued since the last call."""
        out, self._copies = self._copies, []
        return out

    def get_block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.block_tables.get(seq_id, ())]

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (tail first, so head blocks stay free-listed longest)."""
        table = self.block_tables.pop(seq.seq_id, None)
        self._num_cached_blocks.pop(seq.seq_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))
        self.free_swapped(seq)

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seqs: list[Sequence]) -> AllocStatus:
        """Whether the CPU pool can take these sequences' blocks (shared ones count once)."""
        need = len(_unique([self.block_tables.get(s.seq_id, []) for s in seqs]))
        if need > self.cpu_pool.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if need <= self.cpu_pool.num_free_blocks else AllocStatus.LATER

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns ``(device, cpu)`` block-id pairs.

        The device blocks are freed (cached ones keep their hash, so a later hit may reuse them).
        """
        if self.can_swap_out(seqs) != AllocStatus.OK:
            raise RuntimeError("swap_out without room in the CPU pool: check can_swap_out first")
        pairs = self._move(seqs, self.block_tables, self.cpu_block_tables, self.block_pool, self.cpu_pool)
        for s in seqs:
            self._num_cached_blocks.pop(s.seq_id, None)
        return pairs

    def can_swap_in(self, seqs: list[Sequence], num_new_tokens: int, running: bool = True) -> AllocStatus:
        """Whether the device pool can take back these sequences' blocks plus room for
        ``num_new_tokens`` more each. ``running``: others are running, so keep the watermark free."""
        # Every CPU block comes back (shared ones once), plus the growth and copy-on-write.
        need = len(_unique([self.cpu_block_tables.get(s.seq_id, []) for s in seqs]))
        need += self.num_new_blocks((SlotRequest(s, s.num_computed_tokens, num_new_tokens) for s in seqs),
                                    tables=self.cpu_block_tables)
        if need > self.num_blocks:
            return AllocStatus.NEVER
        reserve = self.watermark_blocks if running else 0
        return AllocStatus.OK if need + reserve <= self.num_free_blocks else AllocStatus.LATER

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the sequences' blocks back from the CPU pool; returns ``(cpu, device)`` pairs.

        A full block whose hash is still cached on the device is taken from there (no copy).
        """
        return self._move(seqs, self.cpu_block_tables, self.block_tables, self.cpu_pool, self.block_pool)

    def _move(self, seqs: list[Sequence], src_tables: dict[int, list[KVCacheBlock]],
              dst_tables: dict[int, list[KVCacheBlock]], src_pool: BlockPool,
              dst_pool: BlockPool) -> list[tuple[int, int]]:
        """Give every source block one destination block (shared stays shared), then free the sources."""
        to_device = dst_pool is self.block_pool
        mapping: dict[int, KVCacheBlock] = {}
        pairs: list[tuple[int, int]] = []
        for seq in seqs:
            src = src_tables.pop(seq.seq_id, [])
            dst: list[KVCacheBlock] = []
            for i, b in enumerate(src):
                d = mapping.get(b.block_id)
                if d is None:
                    d = self._cached_on_device(seq, i) if to_device else None
                    if d is not None:
                        dst_pool.touch([d])
                    else:
                        d = dst_pool.get_new_blocks(1)[0]
                        pairs.append((b.block_id, d.block_id))
                    mapping[b.block_id] = d
                else:
                    dst_pool.touch([d])
                dst.append(d)
            dst_tables[seq.seq_id] = dst
            src_pool.free_blocks(reversed(src))
        return pairs

    def _cached_on_device(self, seq: Sequence, i: int) -> KVCacheBlock | None:
        """Block ``i`` of ``seq`` if it is full, computed and its hash is still cached on the device."""
        if not self.enable_caching or i >= len(seq.block_hashes) or (i + 1) * self.block_size > seq.num_computed_tokens:
            return None
        return self.block_pool.get_cached_block(seq.block_hashes[i])

    def free_swapped(self, seq: Sequence) -> None:
        """Drop a swapped-out sequence's CPU blocks (it was aborted or finished while swapped)."""
        table = self.cpu_block_tables.pop(seq.seq_id, None)
        if table:
            self.cpu_pool.free_blocks(reversed(table))

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, live_seq_ids: set[int] | None = None, swapped_seq_ids: set[int] | None = None) -> None:
        """Both pools' invariants, ref counts equal to owners, and (if given) tables only for the
        live (device) and swapped (CPU) sequences."""
        for pool, tables in ((self.block_pool, self.block_tables), (self.cpu_pool, self.cpu_block_tables)):
            pool.check_invariants()
            owners: dict[int, int] = {}
            for table in tables.values():
                if len({b.block_id for b in table}) != len(table):
                    raise InvariantError("a block appears twice in one table")
                for b in table:
                    owners[b.block_id] = owners.get(b.block_id, 0) + 1
            for b in pool.blocks:
                if b.ref_cnt != owners.get(b.block_id, 0):
                    raise InvariantError(f"{b} ref_cnt != {owners.get(b.block_id, 0)} owners")
        for b in self.cpu_pool.blocks:
            if b.block_hash is not None:
                raise InvariantError(f"CPU {b} carries a prefix-cache hash")
        if set(self.block_tables) & set(self.cpu_block_tables):
            raise InvariantError("a sequence has device and CPU blocks")
        if live_seq_ids is not None:
            stray = set(self.block_tables) - live_seq_ids
            if stray:
                raise InvariantError(f"block tables kept for sequences no longer scheduled: {sorted(stray)}")
        if swapped_seq_ids is not None and not (set(self.cpu_block_tables) == swapped_seq_ids):
            raise InvariantError("CPU block tables differ from swapped sequences")
