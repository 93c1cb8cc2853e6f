"""Send each step's ``SchedulerOutput`` to out-of-process workers as a diff (vLLM V1's idea).

A sequence is sent whole the first time a worker sees it (prompt, sampling parameters, block
table); afterwards only what changed: its scheduled tokens, the block ids appended to its table
(or the whole table when it was replaced: preemption, swap-in, copy-on-write of the last block)
and its new output tokens. The worker keeps the sequences and rebuilds the full
``SchedulerOutput``, so the model runner sees exactly what the in-process worker sees::

    driver: StepEncoder.encode(so) --pickle--> worker: StepDecoder.decode(delta) == so
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagellm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagellm.sampling_params import SamplingParams


@dataclass(slots=True)
class SequenceDelta:
    """One scheduled sequence; ``request_id``, ``prompt_token_ids`` and ``sampling_params`` are set
    only the first time (``None`` afterwards)."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    do_sample: bool
    sample_seq_ids: list[int] | None
    block_ids: list[int]  # appended to the worker's table, or the whole table if replace_blocks
    replace_blocks: bool
    new_output_token_ids: list[int]
    spec_token_ids: list[int] | None = None
    lora_slot: int = -1
    mm_spans: list[tuple[int, int, str]] | None = None  # (this step's images: sent every step)
    request_id: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None
    mrope_layout: list[tuple[int, int, int, int, int]] | None = None
    # (every group's whole tables, every step: a window's null blocks rewrite a table's head)
    group_block_ids: list[list[int]] | None = None


@dataclass(slots=True)
class SchedulerOutputDelta:
    """The step's sequences as diffs; ``rest`` is the ``SchedulerOutput`` without its sequences."""

    seqs: list[SequenceDelta]
    rest: SchedulerOutput


class StepEncoder:
    """Driver side: remembers, per sequence, the block table and output length already sent."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[list[int], int]] = {}

    def encode(self, so: SchedulerOutput) -> SchedulerOutputDelta:
        for seq_id in so.finished_seq_ids:
            self._sent.pop(seq_id, None)
        deltas = []
        for s in so.scheduled:
            prev = self._sent.get(s.seq_id)
            if prev is None:
                d = SequenceDelta(s.seq_id, s.token_ids, s.num_computed_tokens, s.do_sample, s.sample_seq_ids,
                                  list(s.block_ids), True, list(s.output_token_ids), s.spec_token_ids,
                                  s.lora_slot, s.mm_spans, s.request_id, list(s.prompt_token_ids), s.sampling_params,
                                  s.mrope_layout, s.group_block_ids)
            else:
                blocks, n_out = prev
                n = len(blocks)
                appended = len(s.block_ids) >= n and s.block_ids[:n] == blocks
                d = SequenceDelta(s.seq_id, s.token_ids, s.num_computed_tokens, s.do_sample, s.sample_seq_ids,
                                  s.block_ids[n:] if appended else list(s.block_ids), not appended,
                                  s.output_token_ids[n_out:], s.spec_token_ids, s.lora_slot, s.mm_spans,
                                  group_block_ids=s.group_block_ids)
            self._sent[s.seq_id] = (list(s.block_ids), len(s.output_token_ids))
            deltas.append(d)
        return SchedulerOutputDelta(deltas, replace(so, scheduled=[]))

    @property
    def num_tracked(self) -> int:
        return len(self._sent)


class StepDecoder:
    """Worker side: applies each delta to its copy of the sequences."""

    def __init__(self) -> None:
        self._seqs: dict[int, ScheduledSequence] = {}

    def decode(self, delta: SchedulerOutputDelta) -> SchedulerOutput:
        for seq_id in delta.rest.finished_seq_ids:
            self._seqs.pop(seq_id, None)
        scheduled = []
        for d in delta.seqs:
            if d.request_id is not None:
                assert d.prompt_token_ids is not None and d.sampling_params is not None
                s = ScheduledSequence(d.request_id, d.seq_id, d.token_ids, d.num_computed_tokens, d.block_ids,
                                      d.do_sample, d.sampling_params, d.new_output_token_ids, d.prompt_token_ids,
                                      d.sample_seq_ids, d.spec_token_ids, d.lora_slot, d.mm_spans, d.mrope_layout,
                                      d.group_block_ids)
                self._seqs[d.seq_id] = s
            else:
                s = self._seqs[d.seq_id]
                s.token_ids, s.num_computed_tokens, s.do_sample = d.token_ids, d.num_computed_tokens, d.do_sample
                s.sample_seq_ids, s.spec_token_ids, s.lora_slot = d.sample_seq_ids, d.spec_token_ids, d.lora_slot
                s.mm_spans, s.group_block_ids = d.mm_spans, d.group_block_ids
                if d.replace_blocks:
                    s.block_ids = d.block_ids
                else:
                    s.block_ids.extend(d.block_ids)
                s.output_token_ids.extend(d.new_output_token_ids)
            scheduled.append(s)
        return replace(delta.rest, scheduled=scheduled)

    @property
    def num_tracked(self) -> int:
        return len(self._seqs)
