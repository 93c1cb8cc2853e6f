"""The scheduler's side of the encoder cache (vLLM V1's ``EncoderCacheManager``) and the encoder
budget of a step.

The worker keeps each image's encoder output (its rows for the text model) by content hash; this
manager mirrors what it holds, in rows, within ``cache_size``. A request references an image's
entry from the step whose chunk first overlaps the image's placeholders until every one of its
sequences has computed past them; an entry nobody references stays cached (reused by a later
request with the same image) until its room is needed, least recently freed first. Each step may
encode at most ``budget`` rows (``max_num_encoder_input_tokens``).

A chunk that overlaps an image runs only if the image's rows are cached or encoded in the same
step (before the text model runs); otherwise it stops before the image.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pagellm.mm_inputs import MultiModalFeature
from pagellm.sequence import SequenceGroup
from pagellm.utils import InvariantError


class EncoderCacheManager:
    def __init__(self, cache_size: int, budget: int) -> None:
        self.cache_size = cache_size
        self.budget = budget
        self.sizes: dict[str, int] = {}  # every cached entry: mm_hash -> rows
        # Referenced entries: mm_hash -> (request id, image index) pairs (a request may show one image twice).
        self.refs: dict[str, set[tuple[str, int]]] = {}
        self.freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced entries, oldest first
        self.num_used = 0  # rows of every cached entry
        self.step_budget = budget  # rows this step may still encode
        self.to_encode: list[tuple[str, object]] = []  # this step's (mm_hash, encoder input)
        self.freed: list[str] = []  # evicted since the last step: the worker drops them
        self.hits = 0  # images found cached (another request's, or this one's before a preemption)
        self.misses = 0  # images encoded

    def begin_step(self) -> None:
        self.step_budget = self.budget
        self.to_encode = []

    def num_new_tokens(self, group: SequenceGroup, start: int, n: int) -> int:
        """How many of ``n`` tokens from ``start`` may run this step: all, or up to the first image
        whose rows are neither cached nor encodable now (budget or room). Changes nothing."""
        budget, room = self.step_budget, self.cache_size - self.num_used + self._freeable_rows()
        for f in group.mm_features:
            if f.offset >= start + n:
                break
            if not f.overlaps(start, start + n):
                continue
            if f.mm_hash in self.sizes:
                if f.mm_hash in self.freeable:
                    room -= f.length  # referenced before anything is allocated: not room for others
                continue
            if f.length > budget or f.length > room:
                return max(f.offset - start, 0)
            budget -= f.length
            room -= f.length
        return n

    def schedule(self, group: SequenceGroup, start: int, n: int) -> None:
        """``group``'s chunk ``[start, start + n)`` runs this step: reference every image it
        overlaps, encoding (and allocating) those not cached. The cached ones are referenced first,
        as ``num_new_tokens`` counted them: room made for an image encoded now must not evict an
        unreferenced entry the same chunk needs (it would be encoded again, past the budget)."""
        overlapped = [(i, f) for i, f in enumerate(group.mm_features)
                      if f.overlaps(start, start + n) and i not in group.encoder_refs]
        for i, f in sorted(overlapped, key=lambda p: p[1].mm_hash not in self.sizes):  # (stable: in order)
            if f.mm_hash in self.sizes:
                self.hits += 1
                self.freeable.pop(f.mm_hash, None)
            else:
                self._allocate(f)
            self.refs.setdefault(f.mm_hash, set()).add((group.request_id, i))
            group.encoder_refs.add(i)

    def _allocate(self, f: MultiModalFeature) -> None:
        while self.num_used + f.length > self.cache_size:
            old, _ = self.freeable.popitem(last=False)  # (num_new_tokens made sure there is room)
            self.num_used -= self.sizes.pop(old)
            self.freed.append(old)
        if f.mm_hash in self.freed:
            self.freed.remove(f.mm_hash)  # evicted and wanted again this step: encoded again
        self.sizes[f.mm_hash] = f.length
        self.num_used += f.length
        self.step_budget -= f.length
        self.to_encode.append((f.mm_hash, f.data))
        self.misses += 1

    def release_computed(self, group: SequenceGroup) -> None:
        """Drop ``group``'s references to images every live sequence has computed past."""
        if not group.encoder_refs:
            return
        computed = min((s.num_computed_tokens for s in group.live_seqs()), default=0)
        for i in [i for i in group.encoder_refs if group.mm_features[i].end <= computed]:
            self._unref(group, i)

    def release(self, group: SequenceGroup) -> None:
        """Drop all of ``group``'s references (it finished or was preempted)."""
        for i in list(group.encoder_refs):
            self._unref(group, i)

    def _unref(self, group: SequenceGroup, i: int) -> None:
        h = group.mm_features[i].mm_hash
        group.encoder_refs.discard(i)
        holders = self.refs[h]
        holders.discard((group.request_id, i))
        if not holders:
            del self.refs[h]
            self.freeable[h] = None

    def take_freed(self) -> list[str]:
        out, self.freed = self.freed, []
        return out

    def _freeable_rows(self) -> int:
        return sum(self.sizes[h] for h in self.freeable)

    def stats(self) -> dict[str, Any]:
        """``SchedulerStats``' encoder fields."""
        return {"encoder_cache_usage": self.usage, "encoder_cache_hits": self.hits,
                "encoder_cache_misses": self.misses}

    @property
    def usage(self) -> float:
        """The share of the cache's rows that referenced entries hold."""
        return (self.num_used - self._freeable_rows()) / self.cache_size if self.cache_size else 0.0

    def check_invariants(self, running: dict[str, SequenceGroup]) -> None:
        """Rows add up within capacity; every entry referenced or freeable; only running requests
        hold references, each to an image it has."""
        if self.num_used != sum(self.sizes.values()) or self.num_used > self.cache_size:
            raise InvariantError(f"encoder cache: {self.num_used} rows used, entries hold {sum(self.sizes.values())}, "
                                 f"capacity {self.cache_size}")
        if set(self.refs) & set(self.freeable) or set(self.refs) | set(self.freeable) != set(self.sizes):
            raise InvariantError("encoder cache: every entry is either referenced or freeable, never both")
        for h, holders in self.refs.items():
            for rid, i in holders:
                group = running.get(rid)
                if group is None or i not in group.encoder_refs or group.mm_features[i].mm_hash != h:
                    raise InvariantError(f"encoder cache: {rid!r} holds {h} but is not running or has no such image")
        held = {(g.request_id, i) for g in running.values() for i in g.encoder_refs}
        if held != {pair for holders in self.refs.values() for pair in holders}:
            raise InvariantError("encoder cache: a request's references and the cache's disagree")
