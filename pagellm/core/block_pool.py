"""The pool of KV cache blocks: ref counts, an O(1) free list, and the prefix cache.

Free blocks live in ``FreeKVCacheBlockQueue``, a doubly linked list threaded through the blocks
themselves between two sentinels, so taking a block from the head, returning one to either end and
unlinking one from the middle (a prefix-cache hit) are all O(1) without allocation::

    head <-> b7 <-> b2 <-> b5 <-> tail        popleft() -> b7;  append(b9) -> ... b5 <-> b9 <-> tail

Prefix caching: a full, computed block carries ``block_hash`` (see ``hash_block_tokens``) and is
findable through ``cached_block_hash_to_block`` even after it is freed, until it is evicted. The
free list is the eviction order: blocks without a hash are freed to the head (reused first, they
hold nothing findable), hashed ones to the tail (least recently used at the head)::

    head -> [unhashed ... | hashed, least recently freed ... most recently freed] <- tail
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagellm.utils import InvariantError

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None) -> BlockHash:
    """SHA-256 over (parent hash, token ids, extra key): a chain, so equal hashes mean equal prefixes.

    A cryptographic hash, so a collision (two different prefixes sharing K/V) is not a practical
    concern and hits need no token comparison. ``extra_key`` (the request's ``cache_salt``) enters
    the first block only; the chain carries it into every later one.
    """
    h = hashlib.sha256()
    h.update(parent or b"pagellm-root")
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"\x00salt\x00" + extra_key.encode())
    return h.digest()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block: ``block_size`` token slots in every layer's K and V tensors."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = ", cached" if self.block_hash is not None else ""
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


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

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free list")
        nxt = prev.next_free
        assert nxt is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """To the tail: evicted last."""
        assert self._tail.prev_free is not None
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """To the head: reused first."""
        self._insert_after(self._head, block)

    def __iter__(self):  # head to tail; for invariants and tests only
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """All physical KV blocks of one device, handed out with ref counts, plus the prefix cache.

    ``get_new_blocks`` takes from the head of the free list (evicting the block's cached hash if it
    has one); ``free_blocks`` returns blocks whose ref count drops to zero, unhashed ones to the
    head and hashed ones to the tail. Callers free a sequence's blocks tail first, so among blocks
    freed together the sequence's tail is evicted before its head (the head is what a later
    request with the same prefix wants).
    """

    def __init__(self, num_blocks: int, reserve_null: bool = False) -> None:
        """``reserve_null``: block 0 is the null block, never handed out: what a sliding-window
        group's table holds where the window has left (no K/V there is ever read)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[0] if reserve_null and num_blocks else None
        self.free_block_queue = FreeKVCacheBlockQueue(b for b in self.blocks if b is not self.null_block)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold K/V: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_block_queue.popleft()
            if b.block_hash is not None:  # evict: its K/V are about to be overwritten
                del self.cached_block_hash_to_block[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the free list. The
        null block (never held) is passed over."""
        for b in blocks:
            if b is self.null_block:
                continue
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_block_queue.appendleft(b)
                else:
                    self.free_block_queue.append(b)

    # ------------------------------------------------------------------ prefix cache
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free list (O(1) each); the
        null block is passed over."""
        for b in blocks:
            if b is self.null_block:
                continue
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make a full, computed block findable. If an equal block is already cached, keep that one."""
        if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use (like vLLM); returns success."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for b in self.cached_block_hash_to_block.values():
            b.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks if self.num_usable_blocks else 0.0

    def check_invariants(self) -> None:
        """Free list holds exactly the blocks with ref_cnt 0, each once, and its count is right."""
        seen: set[int] = set()
        for b in self.free_block_queue:
            if b.block_id in seen:
                raise InvariantError(f"{b} twice in the free list")
            if b.ref_cnt != 0:
                raise InvariantError(f"{b} is in the free list with ref_cnt {b.ref_cnt}")
            seen.add(b.block_id)
        if len(seen) != self.free_block_queue.num_free_blocks:
            raise InvariantError("free count out of sync")
        null = self.null_block
        if null is not None and (null.ref_cnt or null.block_hash is not None or null.block_id in seen):
            raise InvariantError(f"the null {null} is held, hashed or free")
        for b in self.blocks:
            if b is null:
                continue
            if b.ref_cnt < 0:
                raise InvariantError(f"{b} has a negative ref_cnt")
            if (b.ref_cnt == 0) != (b.block_id in seen):
                raise InvariantError(f"{b} free-list membership wrong")
            if b.block_hash is not None and self.cached_block_hash_to_block.get(b.block_hash) is not b:
                raise InvariantError(f"{b} hashed but not in the map")
        for h, b in self.cached_block_hash_to_block.items():
            if b.block_hash != h:
                raise InvariantError(f"hash map points at {b} whose hash differs")
        # Unhashed free blocks all precede hashed ones (reused before anything findable is evicted).
        hashed_seen = False
        for b in self.free_block_queue:
            if b.block_hash is not None:
                hashed_seen = True
            else:
                if hashed_seen:
                    raise InvariantError(f"unhashed {b} sits behind cached blocks in the free list")
