"""Block tables: which physical blocks hold each sequence's K/V.

``allocate_slots(seq, n)`` makes room for ``n`` more tokens after ``seq.num_computed_tokens``;
it returns the newly added blocks (possibly none) or ``None`` when the pool cannot supply them,
which tells the scheduler to preempt someone::

    block_table:  [b3][b8][b1]           block_size = 4
    tokens:       xxxx xxxx xx..         num_computed_tokens = 10, n = 5 -> needs cdiv(15, 4) = 4 blocks
                                         -> one new block, appended to the table
"""

from __future__ import annotations

from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.sequence import Sequence
from pagellm.utils import cdiv


class KVCacheManager:
    """Maps sequences to their blocks in one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[KVCacheBlock]] = {}

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

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Grow ``seq``'s block table to hold ``num_computed_tokens + num_new_tokens`` tokens."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        table = self.block_tables.setdefault(seq.seq_id, [])
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(table)
        if need <= 0:
            return []
        if need > self.block_pool.num_free_blocks:
            if not table:
                del self.block_tables[seq.seq_id]
            return None
        new = self.block_pool.get_new_blocks(need)
        table.extend(new)
        return new

    def get_block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.block_tables.get(seq_id, ())]

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (tail first, so head blocks stay free-listed longest)."""
        table = self.block_tables.pop(seq.seq_id, None)
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
        if live_seq_ids is not None:
            stray = set(self.block_tables) - live_seq_ids
            assert not stray, f"block tables kept for sequences no longer scheduled: {sorted(stray)}"
