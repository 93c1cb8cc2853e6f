"""The pool of KV cache blocks: ref counts and an O(1) free list.

Free blocks live in ``FreeKVCacheBlockQueue``, a doubly linked list threaded through the blocks
themselves between two sentinels, so taking a block from the head, returning one to the tail and
unlinking one from the middle (a future prefix-cache hit) are all O(1) without allocation::

    head <-> b7 <-> b2 <-> b5 <-> tail        popleft() -> b7;  append(b9) -> ... b5 <-> b9 <-> tail
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block: ``block_size`` token slots in every layer's K and V tensors."""

    block_id: int
    ref_cnt: int = 0
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked free list with sentinels; ``num_free_blocks`` is kept, never counted."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free list")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):  # head to tail; for invariants and tests only
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """All physical KV blocks of one device, handed out with ref counts.

    ``get_new_blocks`` takes from the head of the free list, ``free_blocks`` returns blocks whose
    ref count drops to zero to the tail (callers pass a sequence's blocks tail first, so its head
    blocks stay in the pool longest: they are the ones a later prefix hit wants).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_block_queue.popleft()
            b.ref_cnt = 1
            out.append(b)
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the free list."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_block_queue.append(b)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def check_invariants(self) -> None:
        """Free list holds exactly the blocks with ref_cnt 0, each once, and its count is right."""
        seen: set[int] = set()
        for b in self.free_block_queue:
            assert b.block_id not in seen, f"{b} twice in the free list"
            assert b.ref_cnt == 0, f"{b} is in the free list with ref_cnt {b.ref_cnt}"
            seen.add(b.block_id)
        assert len(seen) == self.free_block_queue.num_free_blocks, "free count out of sync"
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"{b} has a negative ref_cnt"
            assert (b.ref_cnt == 0) == (b.block_id in seen), f"{b} free-list membership wrong"
