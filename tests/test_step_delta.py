"""The diff the out-of-process executors send decodes to exactly the ``SchedulerOutput`` encoded."""

from __future__ import annotations

import copy
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagellm.executor.step_delta import StepDecoder, StepEncoder
from pagellm.sampling_params import SamplingParams

FIELDS = ("request_id", "seq_id", "token_ids", "num_computed_tokens", "block_ids", "do_sample", "sampling_params",
          "output_token_ids", "prompt_token_ids", "sample_seq_ids", "spec_token_ids",
          "lora_slot", "mm_spans", "mrope_layout")

# One action per live sequence and step: decode one token (or verify drafts; sometimes a new block), replace the
# block table (preemption / swap-in), replace the last block (copy-on-write), skip the step, finish.
actions = st.lists(st.lists(st.sampled_from(["decode", "draft", "new_block", "replace", "cow", "skip", "finish"]),
                            min_size=4, max_size=4), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(actions)
def test_decoded_steps_equal_the_encoded_ones(steps):
    enc, dec = StepEncoder(), StepDecoder()
    params = SamplingParams(temperature=0)
    seqs = {i: ScheduledSequence(f"r{i}", i, [1, 2, 3], 0, [10 * i], True, params, [], [1, 2, 3],
                                 mrope_layout=[(1, 2, 1, 1, 2)] if i % 2 else None)
            for i in range(4)}
    next_block = 100
    finished: list[int] = []
    for step in steps:
        scheduled = []
        for seq_id, action in zip(sorted(seqs), step, strict=False):
            s = seqs[seq_id]
            if action == "finish":
                del seqs[seq_id]
                finished.append(seq_id)
                continue
            if action == "skip":
                continue
            s.num_computed_tokens += len(s.token_ids)
            s.output_token_ids.append(seq_id + len(s.output_token_ids))
            s.token_ids = [s.output_token_ids[-1]]
            s.spec_token_ids = [7, seq_id] if action == "draft" else None  # drafts verified this step
            s.mm_spans = [(s.num_computed_tokens, 2, f"img{seq_id}")] if action == "new_block" else None
            if s.spec_token_ids:
                s.token_ids = s.token_ids + s.spec_token_ids
            if action == "new_block":
                s.block_ids.append(next_block)
            elif action == "replace":
                s.block_ids = [next_block + j for j in range(len(s.block_ids))]
            elif action == "cow":
                s.block_ids[-1] = next_block
            next_block += len(s.block_ids)
            scheduled.append(s)
        so = SchedulerOutput(copy.deepcopy(scheduled), finished_seq_ids=finished)
        finished = []
        decoded = dec.decode(pickle.loads(pickle.dumps(enc.encode(so))))  # as it crosses a process
        assert [[getattr(s, f) for f in FIELDS] for s in decoded.scheduled] == \
            [[getattr(s, f) for f in FIELDS] for s in so.scheduled]
        assert dec.num_tracked == enc.num_tracked
    assert dec.num_tracked <= len(seqs)
