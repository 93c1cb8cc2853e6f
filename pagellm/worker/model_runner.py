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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from pagellm.attention.metadata import AttentionMetadata, StateMetadata
from pagellm.attention.torch_paged import TorchPagedAttention
from pagellm.core.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledSequence, SchedulerOutput
from pagellm.layers.custom_op import select_kernels
from pagellm.layers.pooler import Pooler
from pagellm.lora.layers import ModelLoRA
from pagellm.sampling.rejection_sampler import DraftSpan, rejection_sample
from pagellm.sampling.sampler import Sampler, SamplingRow, apply_token_bitmask
from pagellm.worker.cuda_graph import CudaGraphRunner
from pagellm.worker.decode_graph import DecodeGraphCapture
from pagellm.worker.draft_runner import DraftRunner
from pagellm.worker.input_batch import InputBatch

if TYPE_CHECKING:  # (the runner runs any model through the decoder's interface; it imports none)
    from pagellm.models.decoder import DecoderForCausalLM

# Prompt positions scored per logits call: bounds the float32 vocabulary rows a step holds.
PROMPT_LOGPROBS_ROWS = 256


@dataclass(slots=True)
class PlainSample:
    """One logits row sampled for ``seq_id``; ``parent_seq_id`` is the scheduled sequence (at a
    request's first sample with ``n > 1`` every future fork draws from its parent's row)."""

    logits_row: int
    seq_id: int
    parent_seq_id: int
    row: SamplingRow


@dataclass(slots=True)
class DraftRun:
    """A sequence verifying ``len(seq.spec_token_ids)`` drafts: ``rows`` are its logits rows from
    ``logits_start`` on, one per draft position and one after the last."""

    seq: ScheduledSequence
    logits_start: int
    rows: list[SamplingRow]


@dataclass(slots=True)
class FlatBatch:
    """One step's flat batch (``prepare_inputs``) and what is sampled from it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata  # its slot_mapping filled in
    # The draft model's batch is the target's: its attention metadata is built from these.
    decode_lens: list[int]
    decode_tables: list[list[int]]
    chunk_specs: list[tuple[int, int, list[int]]]
    logits_rows: list[int]  # flat rows whose logits are computed, sequence by sequence
    sample_seqs: list[ScheduledSequence]  # the sequences that sample this step, in logits order
    plain: list[PlainSample] = field(default_factory=list)  # (driver only)
    drafts: list[DraftRun] = field(default_factory=list)  # (driver only)
    # Image rows to write over the token embeddings: (first flat row, mm_hash, first image row, rows).
    mm_segments: list[tuple[int, str, int, int]] = field(default_factory=list)
    # Prompt logprobs to compute: (seq_id, first flat row, its position, the next prompt tokens, k).
    prompt_lp: list[tuple[int, int, int, list[int], int]] = field(default_factory=list)
    # runner="pooling": (seq_id, first flat row, its position, rows, prompt length) per prompt chunk.
    pool_spans: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # ``logits_rows`` is every flat row in order (a decode step): the logits need no gather.
    every_row_samples: bool = False


class ModelRunner:
    """Runs one step of the model for a ``SchedulerOutput``; keeps per-sequence RNGs for seeded sampling.

    Only the driver (tensor-parallel rank 0, or the only worker) samples; other ranks return ``None``.
    """

    def __init__(self, model: DecoderForCausalLM, block_size: int, device: torch.device,
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
        # All layers of a decode-only step in one call, where every op is a compiled kernel.
        self.decode_graphs = DecodeGraphCapture(model)
        # On a GPU: decode-only steps replayed as CUDA graphs (the Worker captures them at start-up).
        self.cuda_graphs: CudaGraphRunner | None = None
        self.pooler: Pooler | None = None  # runner="pooling" (the Worker sets it)
        # A vision-language model's encoder outputs by image hash (what the scheduler's
        # EncoderCacheManager says this worker holds).
        self.encoder_cache: dict[str, torch.Tensor] = {}
        # The running sequences' block tables and sampling rows, kept across steps.
        self.input_batch = InputBatch()
        # Where the KV cache has several layer groups: each layer's group (the Worker sets it,
        # with ``set_kv_groups``), and which groups hold states.
        self.kv_layer_groups: list[int] | None = None
        self.state_groups: set[int] = set()
        self.cached_states = False

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
        """The step's stages: inputs, forward, logits, sample, verify drafts, propose drafts."""
        for seq_id in so.finished_seq_ids:
            self.generators.pop(seq_id, None)
            if self.pooler is not None:
                self.pooler.forget(seq_id)
        if so.finished_seq_ids:
            self.input_batch.remove(so.finished_seq_ids)
        for h in so.freed_encoder_hashes:
            self.encoder_cache.pop(h, None)
        if not so.scheduled:
            return ModelRunnerOutput(sampled={})
        t0 = time.perf_counter()
        if so.encoder_inputs:
            self.encode(so.encoder_inputs)
        t_encoded = time.perf_counter()
        batch = self.prepare_inputs(so)
        t1 = time.perf_counter()
        hidden = self.forward(batch, kv_caches)
        t2 = time.perf_counter()
        if hidden is None:  # a pipeline stage before the last: its hidden states went on
            return None
        prompt_lps = self.prompt_logprobs(batch.prompt_lp, hidden) if batch.prompt_lp else {}
        if not batch.logits_rows:
            return ModelRunnerOutput(sampled={}, timings=(t1 - t0, t2 - t1, 0.0), encoder_seconds=t_encoded - t0,
                                     prompt_logprobs=prompt_lps, pooled=self.pool(batch.pool_spans, hidden)) \
                if self.is_driver else None
        logits = self._logits(batch, hidden)
        if not self.is_driver:
            return None
        result = ModelRunnerOutput(sampled={}, prompt_logprobs=prompt_lps, pooled=self.pool(batch.pool_spans, hidden))
        self.sample(batch, logits, so, result)
        self.verify_drafts(batch, logits, result)
        if self.draft is not None and so.draft_k:
            result.draft_token_ids = self.propose_drafts(so, batch, result)
        if so.num_steps > 1:
            t2 += self.run_more_steps(so, batch, kv_caches, result)
        result.timings = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        result.encoder_seconds = t_encoded - t0
        return result

    def prepare_inputs(self, so: SchedulerOutput) -> FlatBatch:
        """The flat batch (module docstring): decodes first, then each prefill chunk.

        A sequence verifying drafts is one decode row per position (each attending to the cache
        up to itself; all K/V are written before attention), so a verified token is computed
        exactly as a plain decode step would compute it: speculation cannot change greedy outputs."""
        if self._plain_decodes(so.scheduled):
            return self._prepare_decodes(so.scheduled)
        grouped = self.kv_layer_groups is not None
        bs = self.block_size
        decodes = [(s, i) for s in so.scheduled if s.is_decode or s.spec_token_ids
                   for i in range(s.num_scheduled_tokens)]
        if self.lora is not None:  # decodes of one adapter side by side: one slice each in every projection
            decodes.sort(key=lambda d: d[0].lora_slot)
        chunks = [s for s in so.scheduled if not (s.is_decode or s.spec_token_ids)]
        decode_lens = [s.num_computed_tokens + i + 1 for s, i in decodes]
        decode_tables = [s.block_ids for s, _ in decodes]
        chunk_specs = [(s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids) for s in chunks]
        # Plain decodes read their block tables in place from the persistent batch, where the backend can.
        table = self.input_batch.decode_table([s for s, _ in decodes]) \
            if decodes and self.attn_backend.takes_decode_table and len(decodes) == len(so.scheduled) - len(chunks) \
            and not grouped else None
        meta = self.attn_backend.build_metadata(decode_lens, decode_tables, chunk_specs, bs, self.device,
                                                decode_table=table)
        input_ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # seq_id -> flat row of its last token
        draft_row: dict[tuple[int, int], int] = {}  # (seq_id, offset) -> flat row, for drafting sequences
        mm_segments: list[tuple[int, str, int, int]] = []
        prompt_lp: list[tuple[int, int, int, list[int], int]] = []
        pool_spans: list[tuple[int, int, int, int, int]] = []
        # M-RoPE positions (Qwen2-VL), where a request in the step has images: three rows.
        mrope: list[list[int]] | None = [[], [], []] if any(s.mrope_layout for s in so.scheduled) else None
        rows: list[tuple[ScheduledSequence, int]] = []  # (sequence, position) of each flat row
        for s, i in [decodes[j] for j in meta.decode_order]:
            p = s.num_computed_tokens + i
            self._row_features(s, p, 1, len(input_ids), mm_segments, mrope, prompt_lp, pool_spans)
            rows.append((s, p))
            input_ids.append(s.token_ids[i])
            positions.append(p)
            if s.spec_token_ids:
                draft_row[(s.seq_id, i)] = len(input_ids) - 1
            else:
                last_row[s.seq_id] = len(input_ids) - 1
        for s in chunks:
            start = s.num_computed_tokens
            self._row_features(s, start, s.num_scheduled_tokens, len(input_ids), mm_segments, mrope, prompt_lp,
                               pool_spans)
            rows.extend((s, p) for p in range(start, start + s.num_scheduled_tokens))
            input_ids.extend(s.token_ids)
            positions.extend(range(start, start + s.num_scheduled_tokens))
            last_row[s.seq_id] = len(input_ids) - 1
        sample_seqs = [s for s in so.scheduled if s.do_sample]
        logits_rows = _logits_rows(sample_seqs, last_row, draft_row)
        if self.lora is not None:  # each flat row's adapter slot
            self.lora.set_step([decodes[j][0].lora_slot for j in meta.decode_order]
                               + [s.lora_slot for s in chunks for _ in range(s.num_scheduled_tokens)])
        meta.slot_mapping = torch.tensor([s.block_ids[p // bs] * bs + p % bs for s, p in rows], dtype=torch.long,
                                         device=self.device)
        if grouped:
            self._layer_metadata(meta, decodes, chunks, rows)
        if mrope is not None:  # (three equal rows, as in a decode-only step: plain RoPE, decode graphs apply)
            positions = mrope if mrope[0] != mrope[1] or mrope[0] != mrope[2] else mrope[0]  # type: ignore[assignment]
        batch = FlatBatch(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                           torch.tensor(positions, dtype=torch.long, device=self.device), meta,
                           decode_lens, decode_tables, chunk_specs, logits_rows, sample_seqs,
                           mm_segments=mm_segments, prompt_lp=prompt_lp, pool_spans=pool_spans)
        if self.is_driver:
            self._plan_sampling(batch)
        return batch

    def set_kv_groups(self, layer_groups: list[int], state_groups: set[int] | None = None,
                      cached_states: bool = False) -> None:
        """The KV cache has several layer groups: ``layer_groups[i]`` is layer ``i``'s; the
        ``state_groups`` hold states (``StateMetadata``): one block per sequence, or with
        ``cached_states`` one per ``block_size`` tokens, each boundary's state kept for prefix hits."""
        self.kv_layer_groups = layer_groups
        self.state_groups = state_groups or set()
        self.cached_states = cached_states
        self.input_batch = InputBatch(num_groups=max(layer_groups) + 1)

    def _layer_metadata(self, meta: AttentionMetadata, decodes: list[tuple[ScheduledSequence, int]],
                        chunks: list[ScheduledSequence], rows: list[tuple[ScheduledSequence, int]]) -> None:
        """Every KV cache group's metadata into ``meta`` (group 0's): each built the same way from
        its own block tables, over the same flat rows."""
        assert self.kv_layer_groups is not None
        bs = self.block_size
        metas: list[AttentionMetadata | StateMetadata] = [meta]
        for g in range(1, max(self.kv_layer_groups) + 1):
            def table(s: ScheduledSequence, g: int = g) -> list[int]:
                assert s.group_block_ids is not None, "a step over KV cache groups without their block tables"
                return s.group_block_ids[g]
            if g in self.state_groups:
                metas.append(state_metadata(_state_runs(rows, table), bs, self.cached_states))
                continue
            m = self.attn_backend.build_metadata(
                [s.num_computed_tokens + i + 1 for s, i in decodes], [table(s) for s, _ in decodes],
                [(s.num_computed_tokens, s.num_scheduled_tokens, table(s)) for s in chunks], bs, self.device)
            if m.decode_order != meta.decode_order:
                raise RuntimeError("KV cache groups laid a step's decodes out in different orders")
            m.slot_mapping = torch.tensor([table(s)[p // bs] * bs + p % bs for s, p in rows], dtype=torch.long,
                                          device=self.device)
            metas.append(m)
        meta.kv_groups, meta.layer_group = metas, self.kv_layer_groups

    def _plain_decodes(self, seqs: list[ScheduledSequence]) -> bool:
        """Whether every row of the step is a plain decode (one token, none of ``_row_features``) whose
        block table the backend reads from the persistent batch: the steady state of generation."""
        if self.lora is not None or self.pooler is not None or not self.attn_backend.takes_decode_table:
            return False
        return all(s.is_decode and not (s.spec_token_ids or s.mm_spans or s.mrope_layout)
                   and s.sampling_params.prompt_logprobs is None for s in seqs)

    def _prepare_decodes(self, seqs: list[ScheduledSequence]) -> FlatBatch:
        """``prepare_inputs`` for :meth:`_plain_decodes`: row ``b`` is ``seqs[b]``; its token, position,
        slot and context length go into the persistent batch's buffers, its blocks are the table's row."""
        ids, positions, slots, lens = self._decode_columns(seqs, [s.token_ids[0] for s in seqs])
        table = self.input_batch.decode_table(seqs)
        input_ids, pos, slot_mapping, seq_lens = self.input_batch.step_rows(ids, positions, slots, lens,
                                                                            device=self.device)
        meta = self.attn_backend.build_metadata(lens, [], [], self.block_size, self.device, decode_table=table,
                                                seq_lens=seq_lens)
        meta.slot_mapping = slot_mapping
        if self.kv_layer_groups is not None:
            self._group_decodes(meta, seqs, positions, slots, lens, seq_lens)
        rows = [b for b, s in enumerate(seqs) if s.do_sample]
        sample_seqs = [seqs[b] for b in rows]
        batch = FlatBatch(input_ids, pos, meta, lens, [s.block_ids for s in seqs], [], rows, sample_seqs,
                          every_row_samples=len(rows) == len(seqs))
        if self.is_driver:
            self._plan_sampling(batch)
        return batch

    def _group_decodes(self, meta: AttentionMetadata, seqs: list[ScheduledSequence], positions: list[int],
                       group0_slots: list[int], lens: list[int], seq_lens: torch.Tensor) -> None:
        """Plain decodes over KV cache groups: each group's metadata over its rows of the persistent
        batch (in the same order), and all groups' slots and tables for the decode graph."""
        bs, n = self.block_size, len(seqs)
        tables = self.input_batch.group_tables(n)
        slots = [group0_slots]
        metas: list[AttentionMetadata | StateMetadata] = [meta]
        for g in range(1, tables.shape[0]):
            ids = [s.group_block_ids[g] for s in seqs]  # type: ignore[index]
            if g in self.state_groups:
                metas.append(state_metadata([(b, 1, p, t) for b, (t, p) in enumerate(zip(ids, positions, strict=True))],
                                            bs, self.cached_states))
                slots.append([0] * n)  # (no K/V slot: the graph does not take state layers)
                continue
            slots.append([t[p // bs] * bs + p % bs for t, p in zip(ids, positions, strict=True)])
            m = self.attn_backend.build_metadata(lens, [], [], bs, self.device, decode_table=tables[g],
                                                 seq_lens=seq_lens)
            m.slot_mapping = torch.tensor(slots[g], dtype=torch.long, device=self.device)
            metas.append(m)
        meta.kv_groups, meta.layer_group = metas, self.kv_layer_groups
        meta.group_slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        meta.group_tables = tables

    def _decode_columns(self, seqs: list[ScheduledSequence], tokens: list[int],
                        offset: int = 0) -> tuple[list[int], list[int], list[int], list[int]]:
        """Plain decodes' input ids (``tokens``), positions, slots and context lengths, ``offset``
        tokens past their scheduled one (a multi-step step's later passes)."""
        bs = self.block_size
        positions = [s.num_computed_tokens + offset for s in seqs]
        slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(seqs, positions, strict=True)]
        return tokens, positions, slots, [p + 1 for p in positions]

    def _row_features(self, s: ScheduledSequence, start: int, n: int, row: int, mm_segments: list,
                      mrope: list[list[int]] | None, prompt_lp: list, pool_spans: list) -> None:
        """What ``n`` flat rows from ``row`` (positions ``start``...) carry besides their tokens: image
        embeddings, M-RoPE positions, prompt logprobs, pooling spans."""
        if s.mm_spans:
            _image_rows(s.mm_spans, start, n, row, mm_segments)
        if mrope is not None:
            for axis, x in zip(mrope, self.model.rope_positions(s.mrope_layout, start, n), strict=True):
                axis.extend(x)
        if s.sampling_params.prompt_logprobs is not None:
            _prompt_positions(s, start, n, row, prompt_lp)
        if self.pooler is not None:
            pool_spans.append((s.seq_id, row, start, n, len(s.prompt_token_ids)))

    def _plan_sampling(self, batch: FlatBatch) -> None:
        """Each logits row's sampling: a request's first sample with n > 1 draws one token per
        future fork from the same row; a sequence with drafts has one row per position."""
        r = 0
        for s in batch.sample_seqs:
            if s.spec_token_ids:
                gen = self._generator(s.seq_id, s.sampling_params.seed)
                rows = [SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids + s.spec_token_ids[:i],
                                    gen) for i in range(len(s.spec_token_ids) + 1)]
                batch.drafts.append(DraftRun(s, r, rows))
                r += len(rows)
                continue
            for j, seq_id in enumerate(s.sample_seq_ids or [s.seq_id]):
                gen = self._generator(seq_id, s.sampling_params.seed, j)
                batch.plain.append(PlainSample(r, seq_id, s.seq_id, self.input_batch.sampling_row(s, seq_id, gen)))
            r += 1

    def forward(self, batch: FlatBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The model over the batch (a decode-only step through its decode graph where one
        applies); the draft model's K/V follow the target's, token for token."""
        if batch.mm_segments:  # (image rows: the first layer's input is given)
            hidden = self.model(batch.input_ids, batch.positions, kv_caches, batch.meta,
                                inputs_embeds=self.embed_with_images(batch))
        else:
            hidden = self.cuda_graphs.run(batch.input_ids, batch.positions, batch.meta) \
                if self.cuda_graphs is not None else \
                self.decode_graphs.forward(batch.input_ids, batch.positions, kv_caches, batch.meta)
            if hidden is None:
                hidden = self.model(batch.input_ids, batch.positions, kv_caches, batch.meta)
        if self.draft is not None:
            self.draft.forward(batch.input_ids, batch.positions, batch.meta.slot_mapping, batch.decode_lens,
                               batch.decode_tables, batch.chunk_specs, batch.meta.decode_order)
        return hidden

    def prompt_logprobs(self, spans: list[tuple[int, int, int, list[int], int]],
                        hidden: torch.Tensor) -> dict[int, tuple[int, list[dict[int, tuple[float, int]]]]]:
        """Each span's entries: the next prompt token's logprob and rank, and the top ``k``, from the
        raw logits (no temperature or penalties, as vLLM), ``PROMPT_LOGPROBS_ROWS`` rows at a time
        (a step never holds more float32 vocabulary rows than that, whatever its chunk)."""
        out: dict[int, tuple[int, list[dict[int, tuple[float, int]]]]] = {}
        for seq_id, row0, pos0, targets, k in spans:
            entries: list[dict[int, tuple[float, int]]] = []
            for a in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
                tgt = torch.tensor(targets[a:a + PROMPT_LOGPROBS_ROWS], device=hidden.device)
                rows = hidden[row0 + a:row0 + a + tgt.shape[0]]
                lp = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)  # (a collective under TP)
                tok_lp = lp.gather(1, tgt[:, None])
                ranks = (lp > tok_lp).sum(-1) + 1
                top = lp.topk(k, dim=-1) if k else None
                for i, (t, v, r) in enumerate(zip(tgt.tolist(), tok_lp[:, 0].tolist(), ranks.tolist(), strict=True)):
                    entry = {} if top is None else {
                        tt: (vv, j + 1) for j, (tt, vv) in enumerate(zip(top.indices[i].tolist(),
                                                                         top.values[i].tolist(), strict=True))}
                    entry.setdefault(t, (v, r))
                    entries.append(entry)
            out[seq_id] = (pos0, entries)
        return out

    def pool(self, spans: list[tuple[int, int, int, int, int]], hidden: torch.Tensor) -> dict[int, list[float]]:
        """The pooler over each prompt chunk's hidden rows: the vectors of prompts that ended."""
        out: dict[int, list[float]] = {}
        if self.pooler is None:
            return out
        for seq_id, row0, start, n, prompt_len in spans:
            vec = self.pooler.chunk(seq_id, hidden[row0:row0 + n], start, prompt_len)
            if vec is not None:
                out[seq_id] = vec.cpu().tolist()
        return out

    def encode(self, inputs: list[tuple[str, dict[str, Any]]]) -> None:
        """The step's images through the vision encoder (the model batches them), their rows into
        the encoder cache."""
        encode_images = getattr(self.model, "encode_images")  # noqa: B009 - only a vision-language model has it
        images = [{k: torch.from_numpy(v).to(self.device) for k, v in data.items()} for _, data in inputs]
        for (h, _), rows in zip(inputs, encode_images(images), strict=True):
            self.encoder_cache[h] = rows

    def embed_with_images(self, batch: FlatBatch) -> torch.Tensor:
        """The token embeddings with each image's rows written over its placeholders."""
        x = self.model.embed_input_ids(batch.input_ids)
        for row, h, first, n in batch.mm_segments:
            x[row:row + n] = self.encoder_cache[h][first:first + n].to(x.dtype)
        return x

    def sample(self, batch: FlatBatch, logits: torch.Tensor, so: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The plain rows: grammar masks, then the sampler; ``result.sampled`` per sequence."""
        if not batch.plain:
            return
        idx = [p.logits_row for p in batch.plain]
        plain = logits if not batch.drafts and len(idx) == logits.shape[0] else logits[idx]
        if so.grammar_bitmask is not None:  # (constrained sequences never draft)
            constrained = [(i, so.structured_output_rows[p.parent_seq_id]) for i, p in enumerate(batch.plain)
                           if p.parent_seq_id in so.structured_output_rows]
            apply_token_bitmask(plain, so.grammar_bitmask, [i for i, _ in constrained], [m for _, m in constrained])
        out = self.sampler(plain, [p.row for p in batch.plain])
        result.sampled = {p.seq_id: SampledToken(out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
                          for i, p in enumerate(batch.plain)}

    def run_more_steps(self, so: SchedulerOutput, batch: FlatBatch,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], result: ModelRunnerOutput) -> float:
        """A multi-step step's passes after the first (``core/multi_step.py``): each decodes the token
        every row sampled in the pass before, exactly as the next plain step would; the earlier
        samples move to ``earlier_sampled``. Returns the seconds spent in the forward passes.

        Plain decodes on a CPU advance the first pass's batch in place (its inputs are views of the
        persistent batch's buffers; the sampling rows are history-free); any other step is
        prepared afresh each pass."""
        seqs, forward_s = so.scheduled, 0.0
        # (not over KV cache groups: the other groups' slots are not in the step buffers)
        in_place = batch.every_row_samples and self.device.type == "cpu" and self._plain_decodes(seqs) \
            and self.kv_layer_groups is None
        for j in range(1, so.num_steps):
            for s in seqs:
                result.earlier_sampled.setdefault(s.seq_id, []).append(result.sampled[s.seq_id])
            tokens = [result.sampled[s.seq_id].token_id for s in seqs]
            if in_place:
                self.input_batch.advance(*self._decode_columns(seqs, tokens, j))
                sub = so
            else:
                seqs = [replace(s, token_ids=[t], num_computed_tokens=s.num_computed_tokens + 1)
                        for s, t in zip(seqs, tokens, strict=True)]
                sub = SchedulerOutput(scheduled=seqs)
                batch = self.prepare_inputs(sub)
            t = time.perf_counter()
            hidden = self.forward(batch, kv_caches)
            forward_s += time.perf_counter() - t
            assert hidden is not None, "multi-step runs on one stage only"
            self.sample(batch, self._logits(batch, hidden), sub, result)
        return forward_s

    def _logits(self, batch: FlatBatch, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits at the batch's sampled rows (a collective under TP)."""
        return self.model.compute_logits(hidden if batch.every_row_samples else hidden[batch.logits_rows]).float()

    def verify_drafts(self, batch: FlatBatch, logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        """The rejection sampler over every draft run: the accepted drafts in ``spec_accepted``,
        the token after them (a correction or the bonus token) in ``sampled``."""
        if not batch.drafts:
            return
        idx = [d.logits_start + i for d in batch.drafts for i in range(len(d.rows))]
        rows = [row for d in batch.drafts for row in d.rows]
        spans, start = [], 0
        for d in batch.drafts:
            spans.append(DraftSpan(start, d.seq.spec_token_ids or []))
            start += len(d.rows)
        verified = rejection_sample(logits[idx], rows, spans, self.sampler.greedy_and_lse, self.sampler.target_probs)
        for d, v in zip(batch.drafts, verified, strict=True):
            tokens = [SampledToken(t, lp, top) for t, lp, top in zip(v.token_ids, v.logprobs, v.top_logprobs,
                                                                     strict=True)]
            result.sampled[d.seq.seq_id] = tokens.pop()
            result.spec_accepted[d.seq.seq_id] = tokens

    def propose_drafts(self, so: SchedulerOutput, batch: FlatBatch,
                       result: ModelRunnerOutput) -> dict[int, tuple[int, list[int]]]:
        """The draft model's proposals from each listed sequence's last emitted token."""
        assert self.draft is not None
        starts = []
        for s in batch.sample_seqs:
            k = so.draft_k.get(s.seq_id, 0)
            if k:
                accepted = len(result.spec_accepted.get(s.seq_id, ()))
                pos = s.num_computed_tokens + s.num_scheduled_tokens - len(s.spec_token_ids or ()) + accepted
                starts.append((s.seq_id, result.sampled[s.seq_id].token_id, pos, s.block_ids, k))
        return self.draft.propose(starts)


def _state_runs(rows: list[tuple[ScheduledSequence, int]],
               table: Callable[[ScheduledSequence], list[int]]) -> list[tuple[int, int, int, list[int]]]:
    """Each sequence's run of flat rows (they are consecutive in the flat batch): ``(first row,
    rows, first position, its state group's block table)``."""
    runs: list[tuple[int, int, int, list[int]]] = []
    for r, (s, p) in enumerate(rows):
        if runs and r > 0 and rows[r - 1][0] is s:
            first, n, p0, t = runs[-1]
            runs[-1] = (first, n + 1, p0, t)
        else:
            runs.append((r, 1, p, table(s)))
    return runs


def state_metadata(runs: list[tuple[int, int, int, list[int]]], block_size: int, cached: bool) -> StateMetadata:
    """A state group's step (``StateMetadata``) from each sequence's run of rows. Rewritten in its
    one block, one round; ``cached`` (states kept at block boundaries for prefix hits, the table an
    entry per ``block_size`` tokens: ``MambaSpec.kept``): the state after ``p`` tokens lives in
    block ``(p - 1) // block_size``, so a run is cut at the end of the block it starts in part way
    (that block then holds the state at its end, the one its hash names) and at the last boundary
    inside it, each piece continuing in its own block from a copy of the state the piece before
    left in the previous one (a fresh piece from zeros)."""
    if not cached:
        return StateMetadata.in_place([(r0, n, p0 == 0, t[0]) for r0, n, p0, t in runs])
    rounds: list[tuple[list[tuple[int, int]], list[tuple[int, int, bool, int]]]] = []
    for r0, n, p0, t in runs:
        total = p0 + n
        cuts = {c for c in ((p0 // block_size + 1) * block_size if p0 % block_size else 0,
                            total // block_size * block_size) if p0 < c < total}
        p = p0
        for k, end in enumerate(sorted(cuts) + [total]):
            block = t[(end - 1) // block_size]
            if len(rounds) <= k:
                rounds.append(([], []))
            if p > 0 and t[(p - 1) // block_size] != block:
                rounds[k][0].append((t[(p - 1) // block_size], block))
            rounds[k][1].append((r0 + p - p0, end - p, p == 0, block))
            p = end
    return StateMetadata(rounds)


def _logits_rows(sample_seqs: list[ScheduledSequence], last_row: dict[int, int],
                 draft_row: dict[tuple[int, int], int]) -> list[int]:
    """The flat rows whose logits are sampled, sequence by sequence: a sequence's last row, or
    every row of one verifying drafts."""
    rows: list[int] = []
    for s in sample_seqs:
        if s.spec_token_ids:
            rows.extend(draft_row[(s.seq_id, i)] for i in range(s.num_scheduled_tokens))
        else:
            rows.append(last_row[s.seq_id])
    return rows


def _prompt_positions(s: ScheduledSequence, start: int, n: int, row0: int,
                      out: list[tuple[int, int, int, list[int], int]]) -> None:
    """The positions among ``[start, start + n)`` (flat rows from ``row0``) whose logits score the
    next prompt token: every one before the prompt's last (a recomputed output token is not one)."""
    end = min(start + n, len(s.prompt_token_ids) - 1)
    if end > start:
        k = s.sampling_params.prompt_logprobs
        assert k is not None
        out.append((s.seq_id, row0, start, s.prompt_token_ids[start + 1:end + 1], k))


def _image_rows(spans: list[tuple[int, int, str]], start: int, n: int, row0: int,
                out: list[tuple[int, str, int, int]]) -> None:
    """The segments of positions ``[start, start + n)`` (flat rows from ``row0``) that are image
    placeholders: ``(flat row, mm_hash, row in the image's output, count)``."""
    for offset, length, h in spans:
        lo, hi = max(start, offset), min(start + n, offset + length)
        if lo < hi:
            out.append((row0 + lo - start, h, lo - offset, hi - lo))
