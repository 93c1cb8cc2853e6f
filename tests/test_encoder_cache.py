"""The scheduler's encoder cache and budget in pure Python: a simulated worker cache checks that every
chunk overlapping an image finds its rows, that nothing is held past capacity, and that the budget
and the chunk rule hold, under random add / step / abort sequences with shared images."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.config import SchedulerConfig
from pagellm.core.encoder_cache_manager import EncoderCacheManager
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.core.scheduler_output import ModelRunnerOutput, SampledToken
from pagellm.mm_inputs import MultiModalFeature
from pagellm.sequence import SequenceStatus

from conftest_core import make_group


def _scheduler(cache_size: int, budget: int, num_blocks: int = 40, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, True, 16, 0.0)
    return Scheduler(SchedulerConfig(watermark=0.0, **cfg), kv, max_model_len=10_000,
                     encoder=EncoderCacheManager(cache_size, budget))


def _with_images(rid: str, images: list[tuple[int, int]], text: int = 3, **kw):
    """A request: ``text`` tokens, then each image ``(identity, length)`` as placeholders followed by text."""
    tokens, features = [1] * text, []
    for ident, length in images:
        features.append(MultiModalFeature(f"img{ident}", len(tokens), length, data=ident))
        tokens += [99] * length + [1] * text
    group = make_group(rid, 0, tokens=tokens, **kw)
    group.mm_features = features
    return group


class WorkerCache:
    """What a worker does with the encoder fields of each SchedulerOutput."""

    def __init__(self, capacity: int, budget: int) -> None:
        self.rows: dict[str, int] = {}
        self.capacity, self.budget = capacity, budget
        self.encoded = 0

    def step(self, sched: Scheduler):
        out = sched.schedule()
        for h in out.freed_encoder_hashes:
            self.rows.pop(h)
        step_rows = 0
        for h, _ in out.encoder_inputs:
            group_len = next(f.length for g in sched.requests.values() for f in g.mm_features if f.mm_hash == h)
            self.rows[h] = group_len
            step_rows += group_len
            self.encoded += 1
        assert step_rows <= self.budget, "more rows encoded in a step than the encoder budget"
        assert sum(self.rows.values()) <= self.capacity, "the worker holds more rows than the cache's capacity"
        sampled = {}
        for s in out.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            group = sched.requests[s.request_id]
            for f in group.mm_features:
                if f.overlaps(start, end):
                    assert f.mm_hash in self.rows, f"chunk [{start}, {end}) of {s.request_id} runs without {f.mm_hash}"
                    assert (f.offset, f.length, f.mm_hash) in (s.mm_spans or [])
            if s.do_sample:
                for sid in s.sample_seq_ids or [s.seq_id]:
                    sampled[sid] = SampledToken(5, -0.5)
        sched.update_from_output(out, ModelRunnerOutput(sampled))
        sched.check_invariants()
        return out


def test_budget_splits_encoding_and_the_chunk_stops_before_an_image_it_cannot_encode():
    sched = _scheduler(cache_size=32, budget=8, max_num_batched_tokens=100)
    sched.add_request(_with_images("a", [(0, 8), (1, 8)]))
    worker = WorkerCache(32, 8)
    out = worker.step(sched)
    # The first image fits the budget; the chunk stops before the second (at 3 + 8 + 3 = 14).
    assert [h for h, _ in out.encoder_inputs] == ["img0"]
    assert out.scheduled[0].num_scheduled_tokens == 14
    out = worker.step(sched)
    assert [h for h, _ in out.encoder_inputs] == ["img1"] and out.scheduled[0].num_computed_tokens == 14


def test_a_shared_image_is_encoded_once_and_freed_entries_survive_until_room_is_needed():
    sched = _scheduler(cache_size=16, budget=16, max_num_batched_tokens=100)
    worker = WorkerCache(16, 16)
    sched.add_request(_with_images("a", [(0, 8)], max_tokens=2))
    sched.add_request(_with_images("b", [(0, 8)], text=4, max_tokens=2))  # (other text: no prefix-cache hit)
    while sched.has_unfinished_requests():
        worker.step(sched)
    assert worker.encoded == 1 and sched.encoder.hits == 1
    assert "img0" in worker.rows  # freeable, still cached
    sched.add_request(_with_images("c", [(0, 8)], text=5, max_tokens=1))
    sched.add_request(_with_images("d", [(1, 16)], max_tokens=1))  # needs the whole cache: evicts img0 once c is done
    while sched.has_unfinished_requests():
        worker.step(sched)
    assert worker.encoded == 2 and sched.encoder.hits == 2 and set(worker.rows) == {"img1"}


def test_encoding_an_image_does_not_evict_a_cached_one_the_same_chunk_needs():
    """A chunk needing an uncached image, then a cached one nobody references: the budget counts
    the second as cached, so making room for the first must evict another entry, not it (found
    by the random sequences below: it was encoded again, 12 rows in a step of 8)."""
    sched = _scheduler(cache_size=12, budget=8, max_num_batched_tokens=100)
    worker = WorkerCache(12, 8)
    for rid, image in (("b", (1, 8)), ("c", (2, 4))):  # img1 then img2 cached, unreferenced, img1 the oldest
        sched.add_request(_with_images(rid, [image], max_tokens=1))
        while sched.has_unfinished_requests():
            worker.step(sched)
    assert list(sched.encoder.freeable) == ["img1", "img2"] and sched.encoder.num_used == 12
    sched.add_request(_with_images("d", [(3, 4), (1, 8)], max_tokens=1))
    out = worker.step(sched)  # (the worker checks the budget, and that every chunk finds its rows)
    assert out.scheduled[0].num_scheduled_tokens == 21  # the whole prompt, both images in the chunk
    assert [h for h, _ in out.encoder_inputs] == ["img3"] and out.freed_encoder_hashes == ["img2"]
    assert sched.encoder.hits == 1 and set(sched.encoder.sizes) == {"img1", "img3"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.tuples(st.integers(0, 4), st.sampled_from([4, 8, 12])), max_size=3),
              st.integers(1, 6), st.integers(1, 2)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), max_size=40), st.sampled_from([12, 16, 24]), st.sampled_from(["recompute", "swap"]))
def test_random_sequences_keep_every_chunks_images_available(ops, budget, mode):
    sched = _scheduler(cache_size=24, budget=budget, num_blocks=14, max_num_batched_tokens=10,
                       long_prefill_token_threshold=0, preemption_mode=mode)
    worker = WorkerCache(24, budget)
    added: list[str] = []
    for op, *args in ops:
        if op == "add":
            images, max_tokens, n = args
            # (the same identity always has the same length, as one image has one placeholder count)
            images = [(i, 4 * (1 + i % 3)) for i, _ in images]
            rid = f"r{len(added)}"
            sched.add_request(_with_images(rid, images, max_tokens=max_tokens, n=n, seed=1 if n > 1 else None))
            added.append(rid)
        elif op == "step":
            for _ in range(args[0]):
                worker.step(sched)
        elif added:
            sched.finish_requests(added[args[0] % len(added)], SequenceStatus.FINISHED_ABORTED)
            sched.check_invariants()
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        worker.step(sched)
    assert not sched.has_unfinished_requests(), "a request with images never finished"
    assert not sched.encoder.refs and sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
