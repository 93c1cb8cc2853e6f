"""The scheduler's side of KV transfer, pure Python: random traffic over shared prefixes with a
disk connector whose loads deliver a random prefix of the asked blocks (fault injection), random
aborts (also of requests whose blocks are loading) and the ``fail`` policy; invariants after
every step, every block free at the end, nobody stuck."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.kv_connector import DiskConnectorScheduler
from pagellm.core.kv_transfer_admission import KVTransferAdmission
from pagellm.core.scheduler_output import KVConnectorOutput, ModelRunnerOutput, SampledToken
from pagellm.sequence import SequenceStatus

from conftest_core import make_group, make_scheduler


def step(sched, rng: random.Random, failures: bool) -> None:
    out = sched.schedule()
    meta = out.kv_connector_metadata
    report = KVConnectorOutput()
    if meta is not None:
        for rid, items in meta.loads.items():
            report.loaded[rid] = rng.randint(0, len(items)) if failures else len(items)
    sched.update_kv_transfer(report)
    sampled = {sid: SampledToken(5, -0.5) for s in out.scheduled if s.do_sample
               for sid in (s.sample_seq_ids or [s.seq_id])}
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    sched.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 9), st.integers(1, 6)),
            st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0)),
            st.tuples(st.just("abort"), st.integers(0, 40), st.just(0), st.just(0)),
        ),
        max_size=60,
    ),
    st.integers(6, 24),
    st.sampled_from(["recompute", "fail"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_random_traffic_with_a_connector_keeps_invariants(tmp_path_factory, ops, num_blocks, policy, failures, seed):
    bs = 4
    capacity = num_blocks * bs
    sched = make_scheduler(num_blocks=num_blocks, block_size=bs, max_model_len=capacity, max_num_batched_tokens=8,
                           long_prefill_token_threshold=0)
    connector = DiskConnectorScheduler(str(tmp_path_factory.mktemp("kv")), bs, 100, 10**9)
    sched.kv_transfer = KVTransferAdmission(connector, sched.kv_cache_manager, policy)
    rng = random.Random(seed)
    prefixes = [[100 + k] * (6 + 7 * k) for k in range(3)]
    added: list[str] = []
    for op, a, b, c in ops:
        if op == "add":
            tokens = prefixes[a] + list(range(500, 500 + b))
            if len(tokens) < capacity:
                group = make_group(f"r{len(added)}", 0, max_tokens=c, tokens=tokens)
                sched.add_request(group)
                added.append(group.request_id)
        elif op == "step":
            for _ in range(a):
                step(sched, rng, failures)
        elif added:
            sched.finish_requests(added[a % len(added)], SequenceStatus.FINISHED_ABORTED)
            sched.check_invariants()
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        step(sched, rng, failures)
    assert not sched.has_unfinished_requests(), "a request never finished"
    assert not sched.loading
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    if policy == "recompute":
        assert not sched.take_load_failed()
