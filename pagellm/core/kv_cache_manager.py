"""Block tables: which physical blocks hold each sequence's K/V.

``allocate_slots(seq, n)`` makes room for ``n`` more tokens after ``seq.num_computed_tokens``;
it returns the newly added blocks (possibly none) or ``None`` when the pool cannot supply them,
which tells the scheduler to preempt someone::

    block_table:  [b3][b8][b1]           block_size = 4
    tokens:       xxxx xxxx xx..         num_computed_tokens = 10, n = 5 -> needs cdiv(15, 4) = 4 blocks
                                         -> one new block, appended to the table
"""

from __future__ import annotations

from pagellm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagellm.sequence import Sequence
from pagellm.utils import cdiv


class KVCacheManager:
    """Maps sequences to their blocks in one ``BlockPool``; finds and records cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # Off: nothing is ever hashed into the pool, so nothing is ever found there either.
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[KVCacheBlock]] = {}
        # Per sequence: how many leading blocks are already recorded in the prefix cache.
        self._num_cached_blocks: dict[int, int] = {}

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
    def _update_block_hashes(self, seq: Sequence, extra_key: str | None) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, seq.token_ids_range(i * bs, (i + 1) * bs),
                                            extra_key if i == 0 else None))

    def get_computed_blocks(self, seq: Sequence, extra_key: str | None = None) -> list[KVCacheBlock]:
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

    def cache_full_blocks(self, seq: Sequence, extra_key: str | None = None) -> None:
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
    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Grow ``seq``'s block table to hold ``num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` (a new sequence's prefix-cache hit, from ``get_computed_blocks``) start
        the table: they are touched, and ``seq.num_computed_tokens`` must already count them.
        Returns the newly allocated blocks, or ``None`` (and changes nothing) when the pool
        cannot supply them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        computed_blocks = computed_blocks or []
        table = self.block_tables.get(seq.seq_id, [])
        assert not (computed_blocks and table), "prefix hits only start a new block table"
        have = len(table) + len(computed_blocks)
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - have
        # Touching a free cached block takes it out of the free list too.
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(need, 0) + reclaimed > self.block_pool.num_free_blocks:
            return None
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
            table = list(computed_blocks)
        self.block_tables[seq.seq_id] = table
        if need <= 0:
            return []
        new = self.block_pool.get_new_blocks(need)
        table.extend(new)
        return new

    def get_block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.block_tables.get(seq_id, ())]

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (tail first, so head blocks stay free-listed longest)."""
        table = self.block_tables.pop(seq.seq_id, None)
        self._num_cached_blocks.pop(seq.seq_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    def check_invariants(self, live_seq_ids: set[int] | None = None) -> None:
        """Pool invariants, ref counts equal to owners, and (if given) tables only for live sequences."""
        self.block_pool.check_invariants()
        owners: dict[int, int] = {}
        for table in self.block_tables.values():
            for b in table:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            assert b.ref_cnt == owners.get(b.block_id, 0), f"{b} ref_cnt != {owners.get(b.block_id, 0)} owners"
        for table in self.block_tables.values():
            assert len({b.block_id for b in table}) == len(table), "a block appears twice in one table"
        if live_seq_ids is not None:
            stray = set(self.block_tables) - live_seq_ids
            assert not stray, f"block tables kept for sequences no longer scheduled: {sorted(stray)}"
