"""The persistent input batch's block-table rows equal the scheduler's lists after any step sequence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.scheduler_output import ScheduledSequence
from pagellm.sampling_params import SamplingParams
from pagellm.worker.input_batch import InputBatch

# Per live sequence and step: decode (sometimes with a new block), replace the table (preemption,
# swap-in), copy-on-write of the last block, grow past the table's width, skip, finish.
ACTIONS = ["decode", "new_block", "replace", "cow", "grow", "skip", "finish"]
steps_st = st.lists(st.tuples(st.lists(st.sampled_from(ACTIONS), min_size=12, max_size=12),
                              st.randoms(use_true_random=False)), min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(steps_st)
def test_rows_equal_the_block_lists(steps):
    batch = InputBatch(rows=2, width=2)  # small: the steps grow it in both directions
    params = SamplingParams(temperature=0)
    seqs: dict[int, ScheduledSequence] = {}
    next_id, next_block = 0, 1000
    for actions, rnd in steps:
        while len(seqs) < 12 and rnd.random() < 0.5:  # new sequences join
            seqs[next_id] = ScheduledSequence(f"r{next_id}", next_id, [1], 3, [next_block], True, params, [], [1, 2])
            next_id, next_block = next_id + 1, next_block + 1
        finished, scheduled = [], []
        for (seq_id, s), action in zip(list(seqs.items()), actions, strict=False):
            if action == "finish":
                del seqs[seq_id]
                finished.append(seq_id)
            elif action != "skip":
                if action == "new_block":
                    s.block_ids.append(next_block)
                elif action == "grow":
                    s.block_ids.extend(range(next_block, next_block + 5))
                elif action == "replace":
                    s.block_ids = [next_block + j for j in range(len(s.block_ids))]
                elif action == "cow":
                    s.block_ids[-1] = next_block  # (in place, as the KV manager's list changes)
                next_block += 10
                scheduled.append(s)
        batch.remove(finished)
        rnd.shuffle(scheduled)  # any order the scheduler picks
        table = batch.decode_table(scheduled)
        assert table.is_contiguous() and table.shape[0] == len(scheduled)
        for row, s in enumerate(scheduled):
            assert table[row, :len(s.block_ids)].tolist() == s.block_ids
        batch.check_invariants()
        assert set(batch.seq_ids) <= set(seqs)  # finished sequences leave their rows


def test_the_table_grows_in_rows_and_width():
    batch = InputBatch(rows=2, width=2)
    params = SamplingParams(temperature=0)
    seqs = [ScheduledSequence("r", i, [1], 3, list(range(10 * i, 10 * i + 1 + i)), True, params, [], [1])
            for i in range(5)]
    table = batch.decode_table(seqs)
    assert batch.block_table.shape[0] >= 5 and batch.block_table.shape[1] >= 5  # (both grew)
    for row, s in enumerate(seqs):
        assert table[row, :len(s.block_ids)].tolist() == s.block_ids


def test_sampling_rows_are_made_once_per_sequence():
    batch = InputBatch()
    params = SamplingParams(temperature=0)
    s = ScheduledSequence("r", 1, [1], 3, [5], True, params, [7], [1, 2])
    row = batch.sampling_row(s, 1, None)
    assert batch.sampling_row(s, 1, None) is row
    s.output_token_ids.append(8)  # (the same list, one token longer: the row sees it)
    assert batch.sampling_row(s, 1, None).output_token_ids == [7, 8]
    s2 = ScheduledSequence("r", 1, [1], 4, [5], True, SamplingParams(temperature=1), [7, 8], [1, 2])
    assert batch.sampling_row(s2, 1, None) is not row  # other params: a new row
    batch.remove([1])
    assert batch.sampling_row(s2, 1, None).params is s2.sampling_params
