"""``SchedulerOutput`` -> flat batch -> forward -> logits at sample positions -> sampled tokens.

The flat batch puts decodes (one new token with earlier context) first, then each prefill
chunk, so attention runs the decodes as one batched call and each chunk unpadded::

    input_ids:    [d0 d1 d2 | c0 c0 c0 c0 | c1 c1]
    positions:    [17 40  5 |  0  1  2  3 | 32 33]      (num_computed_tokens + i)
    slot_mapping: block_table[pos // block_size] * block_size + pos % block_size
    sample at:    [ 0  1  2 |           6 |     9]      (only chunks that reach the end)
"""

from __future__ import annotations

import time

import torch

from pagellm.attention.torch_paged import TorchPagedAttention
from pagellm.core.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledSequence, SchedulerOutput
from pagellm.layers.custom_op import select_kernels
from pagellm.lora.layers import ModelLoRA
from pagellm.sampling.rejection_sampler import DraftSpan, rejection_sample
from pagellm.sampling.sampler import Sampler, SamplingRow, apply_token_bitmask
from pagellm.worker.draft_runner import DraftRunner


class ModelRunner:
    """Runs one step of the model for a ``SchedulerOutput``; keeps per-sequence RNGs for seeded sampling.

    Only the driver (tensor-parallel rank 0, or the only worker) samples; other ranks return ``None``.
    """

    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device,
                 attn_backend: TorchPagedAttention, is_driver: bool = True) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.is_driver = is_driver
        self.block_size = block_size
        self.device = device
        self.generators: dict[int, torch.Generator] = {}
        self.dtype = next(model.parameters()).dtype
        self.sampler = Sampler()
        select_kernels(self.sampler, device, self.dtype)
        self.draft: DraftRunner | None = None  # speculative decoding with a draft model (Worker sets it)
        self.lora: ModelLoRA | None = None  # multi-LoRA slots (Worker sets them)

    def _generator(self, seq_id: int, seed: int | None, index: int = 0) -> torch.Generator | None:
        """The RNG of sequence ``seq_id``, created on its first sample. Sample ``index`` of a request
        (its fork number) gets its own seed, derived from the request's, so every child is reproducible."""
        if seed is None:
            return None
        g = self.generators.get(seq_id)
        if g is None:
            derived = seed if index == 0 else (seed + index * 0x9E3779B97F4A7C15) % 2**63
            g = torch.Generator(device=self.device).manual_seed(derived)
            self.generators[seq_id] = g
        return g

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> ModelRunnerOutput | None:
        for seq_id in so.finished_seq_ids:
            self.generators.pop(seq_id, None)
        if not so.scheduled:
            return ModelRunnerOutput(sampled={})
        t0 = time.perf_counter()
        bs = self.block_size
        # Decodes as (sequence, offset) rows of one token. A sequence verifying drafts is one
        # decode row per position (each attending to the cache up to itself; all K/V are written
        # before attention), so a verified token is computed exactly as a plain decode step would
        # compute it: speculation cannot change greedy outputs.
        decodes = [(s, i) for s in so.scheduled if s.is_decode or s.spec_token_ids
                   for i in range(s.num_scheduled_tokens)]
        if self.lora is not None:  # decodes of one adapter side by side: one slice each in every projection
            decodes.sort(key=lambda d: d[0].lora_slot)
        chunks = [s for s in so.scheduled if not (s.is_decode or s.spec_token_ids)]
        decode_lens = [s.num_computed_tokens + i + 1 for s, i in decodes]
        decode_tables = [s.block_ids for s, _ in decodes]
        chunk_specs = [(s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids) for s in chunks]
        meta = self.attn_backend.build_metadata(decode_lens, decode_tables, chunk_specs, bs, self.device)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}  # seq_id -> flat row of its last token
        draft_row: dict[tuple[int, int], int] = {}  # (seq_id, offset) -> flat row, for drafting sequences
        for s, i in [decodes[j] for j in meta.decode_order]:
            p = s.num_computed_tokens + i
            slots.append(s.block_ids[p // bs] * bs + p % bs)
            input_ids.append(s.token_ids[i])
            positions.append(p)
            if s.spec_token_ids:
                draft_row[(s.seq_id, i)] = len(input_ids) - 1
            else:
                last_row[s.seq_id] = len(input_ids) - 1
        for s in chunks:
            start = s.num_computed_tokens
            ids = s.block_ids
            for p in range(start, start + s.num_scheduled_tokens):
                slots.append(ids[p // bs] * bs + p % bs)
            input_ids.extend(s.token_ids)
            positions.extend(range(start, start + s.num_scheduled_tokens))
            last_row[s.seq_id] = len(input_ids) - 1
        # Rows to sample, sequence by sequence; a drafting one's positions in order.
        sample_idx: list[int] = []
        sample_seqs = [s for s in so.scheduled if s.do_sample]
        for s in sample_seqs:
            if s.spec_token_ids:
                sample_idx.extend(draft_row[(s.seq_id, i)] for i in range(s.num_scheduled_tokens))
            else:
                sample_idx.append(last_row[s.seq_id])
        if self.lora is not None:  # each flat row's adapter slot
            row_slots = [decodes[j][0].lora_slot for j in meta.decode_order]
            for s in chunks:
                row_slots.extend([s.lora_slot] * s.num_scheduled_tokens)
            self.lora.set_step(row_slots)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        t1 = time.perf_counter()
        hidden = self.model(ids_t, pos_t, kv_caches, meta)
        if self.draft is not None:  # the draft model's K/V follow the target's, token for token
            self.draft.forward(ids_t, pos_t, meta.slot_mapping, decode_lens, decode_tables, chunk_specs,
                               meta.decode_order)
        t2 = time.perf_counter()
        if hidden is None:  # a pipeline stage before the last: its hidden states went on
            return None
        if not sample_idx:
            return ModelRunnerOutput(sampled={}, timings=(t1 - t0, t2 - t1, 0.0)) if self.is_driver else None
        logits = self.model.compute_logits(hidden[sample_idx]).float()  # a collective under TP
        if not self.is_driver:
            return None
        # A request's first sample with n > 1 draws one token per future fork from the same row;
        # a sequence with drafts has one row per position, verified by the rejection sampler.
        row_idx: list[int] = []
        rows: list[SamplingRow] = []
        row_seq_ids: list[int] = []
        row_parents: list[int] = []  # the scheduled sequence (forks share its grammar row)
        spec_idx: list[int] = []
        spec_rows: list[SamplingRow] = []
        spans: list[DraftSpan] = []
        r = 0
        for s in sample_seqs:
            if s.spec_token_ids:
                gen = self._generator(s.seq_id, s.sampling_params.seed)
                spans.append(DraftSpan(len(spec_rows), s.spec_token_ids))
                for i in range(len(s.spec_token_ids) + 1):
                    spec_idx.append(r + i)
                    spec_rows.append(SamplingRow(s.sampling_params, s.prompt_token_ids,
                                                 s.output_token_ids + s.spec_token_ids[:i], gen))
                r += len(s.spec_token_ids) + 1
                continue
            for j, seq_id in enumerate(s.sample_seq_ids or [s.seq_id]):
                row_idx.append(r)
                row_seq_ids.append(seq_id)
                row_parents.append(s.seq_id)
                rows.append(SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids,
                                        self._generator(seq_id, s.sampling_params.seed, j)))
            r += 1
        result = ModelRunnerOutput(sampled={})
        if rows:
            plain = logits if not spec_idx and len(row_idx) == len(sample_idx) else logits[row_idx]
            if so.grammar_bitmask is not None:  # (constrained sequences never draft)
                constrained = [(i, so.structured_output_rows[seq_id]) for i, seq_id in enumerate(row_parents)
                               if seq_id in so.structured_output_rows]
                apply_token_bitmask(plain, so.grammar_bitmask, [i for i, _ in constrained],
                                    [m for _, m in constrained])
            out = self.sampler(plain, rows)
            result.sampled = {seq_id: SampledToken(out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
                              for i, seq_id in enumerate(row_seq_ids)}
        if spans:
            verified = rejection_sample(logits[spec_idx], spec_rows, spans, self.sampler.greedy_and_lse,
                                        self.sampler.target_probs)
            for s, v in zip((s for s in sample_seqs if s.spec_token_ids), verified, strict=True):
                tokens = [SampledToken(t, lp, top) for t, lp, top in
                          zip(v.token_ids, v.logprobs, v.top_logprobs, strict=True)]
                result.sampled[s.seq_id] = tokens.pop()
                result.spec_accepted[s.seq_id] = tokens
        if self.draft is not None and so.draft_k:
            result.draft_token_ids = self._draft(so, sample_seqs, result)
        result.timings = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        return result

    def _draft(self, so: SchedulerOutput, sample_seqs: list[ScheduledSequence],
               result: ModelRunnerOutput) -> dict[int, tuple[int, list[int]]]:
        """The draft model's proposals from each listed sequence's last emitted token."""
        assert self.draft is not None
        starts = []
        for s in sample_seqs:
            k = so.draft_k.get(s.seq_id, 0)
            if k:
                accepted = len(result.spec_accepted.get(s.seq_id, ()))
                pos = s.num_computed_tokens + s.num_scheduled_tokens - len(s.spec_token_ids or ()) + accepted
                starts.append((s.seq_id, result.sampled[s.seq_id].token_id, pos, s.block_ids, k))
        return self.draft.propose(starts)
