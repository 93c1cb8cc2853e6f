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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pagellm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagellm.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec, SlidingWindowSpec
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
    computed_blocks: KVCacheBlocks | list[KVCacheBlock] = field(default_factory=list)


class KVCacheBlocks(list[KVCacheBlock]):
    """A prefix-cache hit: group 0's blocks (as a list), and in ``groups`` the same number of
    leading blocks of every group (a sliding-window group's blocks before its window are the
    null block)."""

    def __init__(self, groups: tuple[list[KVCacheBlock], ...]) -> None:
        super().__init__(groups[0] if groups else ())
        self.groups = groups


def _unique(tables: Iterable[list[KVCacheBlock]], null: KVCacheBlock | None) -> list[KVCacheBlock]:
    seen: dict[int, KVCacheBlock] = {}
    for table in tables:
        for b in table:
            if b is not null:
                seen.setdefault(b.block_id, b)
    return list(seen.values())


def _group_key(block_hash: bytes, group: int) -> bytes:
    """A block hash as group ``group``'s pool key: groups hold equal tokens in different blocks."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class KVCacheManager:
    """Maps sequences to their blocks in one ``BlockPool``, one block table per KV cache group
    (``core/kv_cache_spec.py``); finds and records cached prefixes that every group can serve.

    ``block_tables`` is group 0's tables (all of them: ``group_tables``). A sliding-window group
    gives back, at each ``allocate_slots``, the blocks its next query's window no longer reaches,
    putting the null block in their place; a prefix hit needs only each window's blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, kv_cache_config: KVCacheConfig | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.specs: list[KVCacheSpec] = [FullAttentionSpec(block_size)] if kv_cache_config is None \
            else kv_cache_config.specs
        # Per group: a state group's table is one block, rewritten in place (see _blocks_for), unless
        # its states are kept at block boundaries (``MambaSpec.cache_states``).
        self._is_state = [isinstance(s, MambaSpec) and not s.cache_states for s in self.specs]
        self.has_states = any(isinstance(s, MambaSpec) for s in self.specs)
        for s in self.specs:
            if s.block_size != block_size:
                raise ValueError(f"a group's block_size {s.block_size} differs from block_size {block_size}")
        # Groups that give back leading blocks (a window's; kept states' once the state moved on).
        self._skips = [isinstance(s, SlidingWindowSpec) or (isinstance(s, MambaSpec) and s.cache_states)
                       for s in self.specs]
        windowed = self.has_windows = any(self._skips)
        # Off: nothing is ever hashed into the pool, so nothing is ever found there either.
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, reserve_null=windowed)
        if self.block_pool.num_usable_blocks < 1:
            raise ValueError(f"num_blocks must be >= 2 with sliding-window groups, got {num_blocks}")
        self.null_block = self.block_pool.null_block
        self.group_tables: list[dict[int, list[KVCacheBlock]]] = [{} for _ in self.specs]
        self.block_tables = self.group_tables[0]
        # The CPU swap pool: plain blocks, never hashed (nothing is looked up there).
        self.cpu_pool = BlockPool(num_cpu_blocks, reserve_null=windowed)
        self.cpu_group_tables: list[dict[int, list[KVCacheBlock]]] = [{} for _ in self.specs]
        self.cpu_block_tables = self.cpu_group_tables[0]
        # Admissions and swap-ins leave this many device blocks free for running sequences to grow.
        self.watermark_blocks = int(watermark * num_blocks)
        # Per group and sequence: how many leading blocks are already recorded in the prefix cache.
        self._num_cached_blocks: list[dict[int, int]] = [{} for _ in self.specs]
        self._copies: list[tuple[int, int]] = []
        self.num_window_freed_blocks = 0  # blocks sliding windows gave back (remove_skipped_blocks)

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _blocks_for(self, group: int, num_tokens: int) -> int:
        """Blocks group ``group`` holds for ``num_tokens`` tokens: one per ``block_size`` of them, or
        a state group's one."""
        return 1 if self._is_state[group] else self.num_blocks_for(num_tokens)

    def _write_index(self, group: int, num_computed_tokens: int) -> int:
        """The block of ``group`` the next token writes (a state group writes its one block)."""
        return 0 if self._is_state[group] else num_computed_tokens // self.block_size

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks, over every group, one sequence of ``num_tokens`` holds at once when
        its steps compute at most ``max_chunk_tokens`` each (more than the pool: it never fits)."""
        return sum(s.max_blocks_held(num_tokens, max_chunk_tokens) for s in self.specs)

    def token_capacity(self, max_chunk_tokens: int) -> int:
        """The longest sequence the pool can ever hold (a bound on ``max_model_len``): the largest
        ``n`` with ``max_blocks_held(n) <= num_blocks`` (it grows with ``n``; without a full-attention
        group it stops growing, and the bound is 2**40)."""
        lo, hi = 0, 1 << 40
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.max_blocks_held(mid, max_chunk_tokens) <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

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

    def _cached(self, block_hash: bytes, group: int) -> KVCacheBlock | None:
        return self.block_pool.get_cached_block(_group_key(block_hash, group))

    def _null(self) -> KVCacheBlock:
        if self.null_block is None:
            raise RuntimeError("only a pool with sliding-window groups has a null block")
        return self.null_block

    def _first_read_block(self, group: int, num_computed_tokens: int) -> int:
        """The first block the next query (at ``num_computed_tokens``) of group ``group`` reads."""
        return self.specs[group].num_skipped_tokens(num_computed_tokens) // self.block_size

    def get_computed_blocks(self, seq: Sequence, extra_key: ExtraKey = None) -> KVCacheBlocks:
        """The longest cached prefix of ``seq`` that every group serves (not yet touched).

        Capped at ``(num_tokens - 1) // block_size`` blocks: the last known token is always
        recomputed, because its logits produce the next token::

            tokens  |....|....|....|..       cached: [b4][b9][b2]  -> at most 3 blocks since
                                              num_tokens = 14 -> (14 - 1) // 4 = 3

        A full-attention group serves ``k`` blocks when blocks ``0 .. k-1`` are cached; a
        sliding-window group when the blocks its window reads from position ``k * block_size``
        are (a hit is taken at the longest ``k`` all groups serve)::

            window 8, block_size 4, k = 4:   [--][--][b5][b6]   (positions 9..15 are read)
        """
        empty = KVCacheBlocks(tuple([] for _ in self.specs))
        if not self.enable_caching or any(self._is_state):  # (states rewritten in place: none kept)
            return empty
        self._update_block_hashes(seq, extra_key)
        hashes = seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]
        k = len(hashes)
        found: list[list[KVCacheBlock | None]] = []
        for g, spec in enumerate(self.specs):
            row: list[KVCacheBlock | None] = []
            for h in hashes[:k]:
                b = self._cached(h, g)
                if b is None and isinstance(spec, FullAttentionSpec):
                    k = len(row)  # a full group's hit ends at its first miss
                    break
                row.append(b)
            found.append(row)
        while k > 0 and not all(None not in found[g][self._first_read_block(g, k * self.block_size):k]
                                for g in range(self.num_groups)):
            k -= 1
        if k == 0:
            return empty
        groups: list[list[KVCacheBlock]] = []
        for g in range(self.num_groups):
            first = self._first_read_block(g, k * self.block_size)
            held = [b for b in found[g][first:k] if b is not None]
            groups.append([self._null()] * first + held if first else held)
        return KVCacheBlocks(tuple(groups))

    def cache_full_blocks(self, seq: Sequence, extra_key: ExtraKey = None) -> None:
        """Record the hashes of ``seq``'s blocks that are full and fully computed."""
        if not self.enable_caching or seq.seq_id not in self.block_tables:
            return
        self._update_block_hashes(seq, extra_key)
        for g, tables in enumerate(self.group_tables):
            if self._is_state[g]:
                continue
            table = tables[seq.seq_id]
            n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes), len(table))
            start = self._num_cached_blocks[g].get(seq.seq_id, 0)
            spec = self.specs[g]
            for i in range(start, n_full):
                if table[i] is not self.null_block and (not isinstance(spec, MambaSpec)
                                                        or spec.caches(i, seq.num_prompt_tokens)):
                    self.block_pool.cache_block(table[i], _group_key(seq.block_hashes[i], g))
            self._num_cached_blocks[g][seq.seq_id] = max(start, n_full)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ allocation
    def _hits(self, computed: KVCacheBlocks | list[KVCacheBlock] | None) -> tuple[list[KVCacheBlock], ...]:
        """A hit as one list per group (a plain list: group 0's, where there is only one group)."""
        if isinstance(computed, KVCacheBlocks) and computed.groups:
            return computed.groups
        if computed and self.num_groups > 1:
            raise ValueError("a prefix hit over several KV cache groups is a KVCacheBlocks")
        return (list(computed or []),) + tuple([] for _ in self.specs[1:])

    def num_new_blocks(self, requests: Iterable[SlotRequest],
                       tables: list[dict[int, list[KVCacheBlock]]] | None = None) -> int:
        """Free device blocks that giving every request its slots would take: the one place that
        counts blocks. ``tables``: where each sequence's blocks are now, per group (the device
        block tables by default; the CPU ones for a swap-in, whose blocks must then come back too)::

            per request and group:  cdiv(num_computed_tokens + num_new_tokens, block_size) (a state group: 1)
                                    - len(table) - len(hits)
                                  + 1 if the block the next token writes is shared (copy-on-write)
            once:                 + cached hits nobody holds (touching them takes them off the free list)

        A cached block several requests hit (sibling forks) is reclaimed once. Blocks a window is
        about to give back are not counted: what this returns is enough, never too little.
        """
        tables = self.group_tables if tables is None else tables
        need = 0
        reclaimed: set[int] = set()
        for r in requests:
            for g, hits in enumerate(self._hits(r.computed_blocks)):
                table = tables[g].get(r.seq.seq_id, [])
                need += self._num_added(g, r.num_computed_tokens, r.num_new_tokens, len(table) + len(hits))
                need += self._needs_cow(self._write_index(g, r.num_computed_tokens), table)
                reclaimed.update(b.block_id for b in hits if b.ref_cnt == 0 and b is not self.null_block)
        return need + len(reclaimed)

    def _num_added(self, group: int, num_computed_tokens: int, num_new_tokens: int, held: int) -> int:
        """New blocks group ``group`` takes for a step past the ``held`` entries of its table (a
        kept-state group only those the step writes states into)."""
        total = num_computed_tokens + num_new_tokens
        n = self._blocks_for(group, total)
        spec = self.specs[group]
        if isinstance(spec, MambaSpec) and spec.cache_states:
            return sum(1 for i in spec.kept(num_computed_tokens, total) if i >= held)
        return max(0, n - held)

    def remove_skipped_blocks(self, seq: Sequence) -> int:
        """Give back the blocks of ``seq``'s sliding-window groups that no query from
        ``num_computed_tokens`` on can read, and of its kept-state groups those before its live
        state (the null block takes their place; hashed ones stay cached). Returns how many."""
        freed = 0
        null = self.null_block
        for g, spec in enumerate(self.specs):
            table = self.group_tables[g].get(seq.seq_id)
            if not table or not self._skips[g]:
                continue
            first = min(self._first_read_block(g, seq.num_computed_tokens), len(table))
            # Back to front: a window's nulls are a prefix (stop at the first); kept states leave
            # nulls between the boundaries they kept (pass over them).
            interleaved = isinstance(spec, MambaSpec)
            for i in range(first - 1, -1, -1):
                if table[i] is null:
                    if interleaved:
                        continue
                    break
                self.block_pool.free_blocks([table[i]])
                table[i] = self._null()
                freed += 1
        self.num_window_freed_blocks += freed
        return freed

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: KVCacheBlocks | list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Grow ``seq``'s block tables to hold ``num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` (a new sequence's prefix-cache hit, from ``get_computed_blocks``) start
        the tables: they are touched, and ``seq.num_computed_tokens`` must already count them.
        A shared, partly filled block about to be written is first replaced by a private copy
        (copy-on-write; the copy is queued for ``take_copies``). Sliding-window groups first give
        back what no query can read any more (``remove_skipped_blocks``; kept even if this fails).
        Returns the newly allocated blocks, or ``None`` (and allocates nothing) when the pool
        cannot supply them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        hits = self._hits(computed_blocks)
        if hits[0] and seq.seq_id in self.block_tables:
            raise ValueError(f"prefix hits only start a new block table; sequence {seq.seq_id} has one")
        self.remove_skipped_blocks(seq)
        request = SlotRequest(seq, seq.num_computed_tokens, num_new_tokens, computed_blocks or [])
        if self.num_new_blocks([request]) > self.block_pool.num_free_blocks:
            return None
        new: list[KVCacheBlock] = []
        for g, tables in enumerate(self.group_tables):
            table = tables.get(seq.seq_id, [])
            if hits[g]:
                self.block_pool.touch(hits[g])
                table = list(hits[g])
            tables[seq.seq_id] = table
            i = self._write_index(g, seq.num_computed_tokens)
            if self._needs_cow(i, table):
                old = table[i]
                table[i] = self.block_pool.get_new_blocks(1)[0]
                self._copies.append((old.block_id, table[i].block_id))
                self.block_pool.free_blocks([old])  # still held by its other owners
                new.append(table[i])
            n_blocks = self._blocks_for(g, seq.num_computed_tokens + num_new_tokens)
            if n_blocks > len(table):
                added = self.block_pool.get_new_blocks(self._num_added(g, seq.num_computed_tokens, num_new_tokens,
                                                                       len(table)))
                spec = self.specs[g]
                if isinstance(spec, MambaSpec) and spec.cache_states:  # (the boundaries it does not keep: null)
                    kept = spec.kept(seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens)
                    it = iter(added)
                    table.extend(next(it) if i in kept else self._null() for i in range(len(table), n_blocks))
                else:
                    table.extend(added)
                new.extend(added)
        return new

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Give back the blocks past the first ``num_tokens`` slots (speculative decoding: blocks
        that held only rejected drafts). Returns how many went back."""
        keep = self.num_blocks_for(num_tokens)
        freed = 0
        for g, tables in enumerate(self.group_tables):
            table = tables.get(seq.seq_id)
            if not table or len(table) <= keep or self._is_state[g]:
                continue
            tail = [b for b in table[keep:] if b is not self.null_block]
            del table[keep:]
            self.block_pool.free_blocks(reversed(tail))
            freed += len(tail)
            if self._num_cached_blocks[g].get(seq.seq_id, 0) > keep:
                self._num_cached_blocks[g][seq.seq_id] = keep
        return freed

    @staticmethod
    def _needs_cow(i: int, table: list[KVCacheBlock]) -> bool:
        """Block ``i``, which the next token writes, exists and is shared: it must be copied first."""
        return i < len(table) and table[i].ref_cnt > 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` in every group (one more reference each)."""
        for g, tables in enumerate(self.group_tables):
            table = tables.get(parent.seq_id, [])
            self.block_pool.touch(table)
            tables[child.seq_id] = list(table)
            self._num_cached_blocks[g][child.seq_id] = self._num_cached_blocks[g].get(parent.seq_id, 0)

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies ``(src, dst)`` queued since the last call."""
        out, self._copies = self._copies, []
        return out

    def get_block_ids(self, seq_id: int) -> list[int]:
        """Group 0's block ids of ``seq_id``."""
        return [b.block_id for b in self.block_tables.get(seq_id, ())]

    def get_group_block_ids(self, seq_id: int) -> list[list[int]]:
        """Every group's block ids of ``seq_id`` (the null block's id where a window has left)."""
        return [[b.block_id for b in tables.get(seq_id, ())] for tables in self.group_tables]

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (tail first, so head blocks stay free-listed longest)."""
        for g, tables in enumerate(self.group_tables):
            table = tables.pop(seq.seq_id, None)
            self._num_cached_blocks[g].pop(seq.seq_id, None)
            if table:
                self.block_pool.free_blocks(reversed(table))
        self.free_swapped(seq)

    # ------------------------------------------------------------------ swapping
    def _seq_tables(self, groups: list[dict[int, list[KVCacheBlock]]],
                    seqs: list[Sequence]) -> Iterator[list[KVCacheBlock]]:
        return (tables.get(s.seq_id, []) for tables in groups for s in seqs)

    def can_swap_out(self, seqs: list[Sequence]) -> AllocStatus:
        """Whether the CPU pool can take these sequences' blocks (shared ones count once)."""
        need = len(_unique(self._seq_tables(self.group_tables, seqs), self.null_block))
        if need > self.cpu_pool.num_usable_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if need <= self.cpu_pool.num_free_blocks else AllocStatus.LATER

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns ``(device, cpu)`` block-id pairs.

        The device blocks are freed (cached ones keep their hash, so a later hit may reuse them).
        """
        if self.can_swap_out(seqs) != AllocStatus.OK:
            raise RuntimeError("swap_out without room in the CPU pool: check can_swap_out first")
        pairs = self._move(seqs, self.group_tables, self.cpu_group_tables, self.block_pool, self.cpu_pool)
        for cached in self._num_cached_blocks:
            for s in seqs:
                cached.pop(s.seq_id, None)
        return pairs

    def can_swap_in(self, seqs: list[Sequence], num_new_tokens: int, running: bool = True) -> AllocStatus:
        """Whether the device pool can take back these sequences' blocks plus room for
        ``num_new_tokens`` more each. ``running``: others are running, so keep the watermark free."""
        # Every CPU block comes back (shared ones once), plus the growth and copy-on-write.
        need = len(_unique(self._seq_tables(self.cpu_group_tables, seqs), self.cpu_pool.null_block))
        need += self.num_new_blocks((SlotRequest(s, s.num_computed_tokens, num_new_tokens) for s in seqs),
                                    tables=self.cpu_group_tables)
        if need > self.num_blocks:
            return AllocStatus.NEVER
        reserve = self.watermark_blocks if running else 0
        return AllocStatus.OK if need + reserve <= self.num_free_blocks else AllocStatus.LATER

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the sequences' blocks back from the CPU pool; returns ``(cpu, device)`` pairs.

        A full block whose hash is still cached on the device is taken from there (no copy).
        """
        return self._move(seqs, self.cpu_group_tables, self.group_tables, self.cpu_pool, self.block_pool)

    def _move(self, seqs: list[Sequence], src_groups: list[dict[int, list[KVCacheBlock]]],
              dst_groups: list[dict[int, list[KVCacheBlock]]], src_pool: BlockPool,
              dst_pool: BlockPool) -> list[tuple[int, int]]:
        """Give every source block one destination block (shared stays shared; the null block is
        the other pool's null block), then free the sources."""
        to_device = dst_pool is self.block_pool
        mapping: dict[int, KVCacheBlock] = {}
        pairs: list[tuple[int, int]] = []
        for g, (src_tables, dst_tables) in enumerate(zip(src_groups, dst_groups, strict=True)):
            for seq in seqs:
                src = src_tables.pop(seq.seq_id, [])
                dst: list[KVCacheBlock] = []
                for i, b in enumerate(src):
                    if b is src_pool.null_block:
                        dst.append(dst_pool.null_block)  # type: ignore[arg-type]
                        continue
                    d = mapping.get(b.block_id)
                    if d is None:
                        d = self._cached_on_device(seq, i, g) if to_device else None
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

    def _cached_on_device(self, seq: Sequence, i: int, group: int) -> KVCacheBlock | None:
        """Block ``i`` of ``seq`` in ``group`` if it is full, computed and its hash is still cached on the device."""
        if not self.enable_caching or i >= len(seq.block_hashes) or (i + 1) * self.block_size > seq.num_computed_tokens:
            return None
        return self._cached(seq.block_hashes[i], group)

    def free_swapped(self, seq: Sequence) -> None:
        """Drop a swapped-out sequence's CPU blocks (it was aborted or finished while swapped)."""
        for tables in self.cpu_group_tables:
            table = tables.pop(seq.seq_id, None)
            if table:
                self.cpu_pool.free_blocks(reversed(table))

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, live_seq_ids: set[int] | None = None, swapped_seq_ids: set[int] | None = None) -> None:
        """Both pools' invariants, ref counts equal to owners over every group, every group's
        tables for the same sequences (of one length on the device), null blocks only where a
        window may have left, and (if given) tables only for the live (device) and swapped (CPU)
        sequences."""
        for pool, groups in ((self.block_pool, self.group_tables), (self.cpu_pool, self.cpu_group_tables)):
            pool.check_invariants()
            owners: dict[int, int] = {}
            for g, tables in enumerate(groups):
                if set(tables) != set(groups[0]):
                    raise InvariantError(f"group {g} has tables for other sequences than group 0")
                windowed = self._skips[g]
                for table in tables.values():
                    held = [b for b in table if b is not pool.null_block]
                    if len({b.block_id for b in held}) != len(held):
                        raise InvariantError("a block appears twice in one table")
                    if len(held) != len(table) and not windowed:
                        raise InvariantError(f"group {g} (no window) holds the null block")
                    for b in held:
                        owners[b.block_id] = owners.get(b.block_id, 0) + 1
            for b in pool.blocks:
                if b is not pool.null_block and b.ref_cnt != owners.get(b.block_id, 0):
                    raise InvariantError(f"{b} ref_cnt != {owners.get(b.block_id, 0)} owners")
        for sid in self.block_tables:
            lens = {len(tables[sid]) for g, tables in enumerate(self.group_tables) if not self._is_state[g]}
            if len(lens) > 1:
                raise InvariantError(f"sequence {sid}'s groups hold tables of different lengths")
            if any(len(tables[sid]) != 1 for g, tables in enumerate(self.group_tables) if self._is_state[g]):
                raise InvariantError(f"sequence {sid} holds other than one block of a state group")
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
