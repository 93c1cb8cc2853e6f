"""Block pool and KV cache manager on tiny pools: exact block ids, free order, invariants."""

from __future__ import annotations

import pytest

from pagellm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.sequence import Sequence


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_is_o1_linked_list():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3] and q.num_free_blocks == 3
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 2]
    with pytest.raises(RuntimeError):
        q.append(blocks[2])
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])


def test_pool_allocates_from_head_and_reuses_unhashed_blocks_first():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    assert ids(a) == [0, 1] and ids(b) == [2, 3]
    pool.free_blocks(reversed(a))
    pool.check_invariants()
    # Unhashed blocks hold nothing findable: they go to the head and are reused first.
    assert [blk.block_id for blk in pool.free_block_queue] == [0, 1, 4]
    assert ids(pool.get_new_blocks(3)) == [0, 1, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(RuntimeError):
        pool.free_blocks([KVCacheBlock(9)])


def test_double_free_is_caught():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError):
        pool.free_blocks([blk])


def test_allocate_slots_grows_table_by_block():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    seq = Sequence(0, list(range(6)))
    assert ids(mgr.allocate_slots(seq, 6)) == [0, 1]
    seq.num_computed_tokens = 6
    assert mgr.allocate_slots(seq, 2) == []  # slots 6, 7 fit in block 1
    seq.num_computed_tokens = 8
    assert ids(mgr.allocate_slots(seq, 1)) == [2]
    assert mgr.get_block_ids(0) == [0, 1, 2]
    mgr.check_invariants({0})


def test_allocate_slots_returns_none_without_side_effects_when_full():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    a, b = Sequence(0, [1] * 4), Sequence(1, [1] * 4)
    assert mgr.allocate_slots(a, 4) is not None
    assert mgr.allocate_slots(b, 4) is None
    assert mgr.num_free_blocks == 1 and 1 not in mgr.block_tables
    mgr.check_invariants({0})
    mgr.free(a)
    assert mgr.num_free_blocks == 3
    mgr.check_invariants(set())


def test_invariants_detect_corruption():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    seq = Sequence(0, [1, 2, 3])
    mgr.allocate_slots(seq, 3)
    mgr.block_pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError):
        mgr.check_invariants({0})
