"""Interface objects between the scheduler and the worker (plain data, no torch).

``SchedulerOutput`` goes down: what to compute this step and which block copies to do first.
``ModelRunnerOutput`` comes back: one sampled token (with its logprobs) per sampling sequence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pagellm.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: ``token_ids`` at positions ``num_computed_tokens ...``.

    ``do_sample`` is true when this chunk reaches the end of the sequence's known tokens, so the
    logits of its last position produce the next token (a partial prefill chunk samples nothing).
    """

    request_id: str
    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    do_sample: bool
    sampling_params: SamplingParams
    # Only for penalties and min_tokens: the tokens generated so far (a reference, not a copy).
    output_token_ids: list[int]
    prompt_token_ids: list[int]
    # Parallel sampling: at a request's first sample, one token is drawn from this row's logits
    # for each of these sequence ids (the first is ``seq_id``; the others are the forks to be).
    sample_seq_ids: list[int] | None = None
    # Speculative decoding: the drafts at the end of ``token_ids`` (after the last known token);
    # every position from the last known token on is sampled, and the rejection sampler keeps
    # the drafts the target model agrees with.
    spec_token_ids: list[int] | None = None
    # Multi-LoRA: the device slot of the request's adapter (-1: the base model).
    lora_slot: int = -1
    # Images whose placeholders this chunk overlaps: ``(offset, length, mm_hash)``, their rows in
    # the worker's encoder cache (encoded in this step at the latest).
    mm_spans: list[tuple[int, int, str]] | None = None
    # M-RoPE (Qwen2-VL): every image of the request as ``(offset, length, t, h, w)``, from which the
    # runner computes the positions of any token (``models/qwen2_vl.mrope_positions``).
    mrope_layout: list[tuple[int, int, int, int, int]] | None = None
    # Every KV cache group's block ids where the model has more than one group (group 0's are
    # ``block_ids``; a sliding-window group's hold the null block where its window has left).
    group_block_ids: list[list[int]] | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token after earlier context (a 1-token prompt's prefill is not a decode)."""
        return len(self.token_ids) == 1 and self.num_computed_tokens > 0


@dataclass(slots=True)
class CacheOps:
    """Block copies the worker performs before the forward pass, as ``(src, dst)`` block ids."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.swap_out or self.swap_in or self.copy)


def block_hash_of(name: str) -> bytes:
    """The block hash a connector's name for a block stands for (``<hex>`` or ``<dir>/<hex>.<suffix>``)."""
    return bytes.fromhex(os.path.basename(name).split(".")[0])


@dataclass(slots=True)
class KVConnectorMetadata:
    """A step's K/V transfers (``core/kv_connector.py``), as block ids and the connector's names
    for the blocks: ``loads`` fill a waiting request's blocks before the forward pass, ``saves``
    copy blocks this step computes after it, ``deletes`` drop saved blocks."""

    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    saves: list[tuple[int, str]] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    # A load's block bytes when the engine holds them (blocks another engine pushed): name -> bytes.
    payloads: dict[str, bytes] = field(default_factory=dict)
    # Blocks to push to another engine after the pass: (address, transfer id, [(block id, name)]).
    sends: list[tuple[str, str, list[tuple[int, str]]]] = field(default_factory=list)


@dataclass(slots=True)
class KVConnectorOutput:
    """The worker's report on a step's transfers: ``loaded[request_id]`` is how many of the
    request's blocks arrived intact (always a prefix of its list); names the worker found bad
    (missing, truncated, corrupt, foreign) or could not write; byte and time counters."""

    loaded: dict[str, int] = field(default_factory=dict)
    bad_files: list[str] = field(default_factory=list)
    failed_saves: list[str] = field(default_factory=list)
    blocks_saved: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the worker needs for one step; ``finished_seq_ids`` lets it drop per-sequence state."""

    scheduled: list[ScheduledSequence]
    cache_ops: CacheOps = field(default_factory=CacheOps)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Structured output: ``seq_id -> row`` of ``grammar_bitmask`` (a numpy ``int32 [rows,
    # ceil(vocab / 32)]``, bit set = token allowed), filled by the engine for constrained sequences
    # that sample this step; the worker masks their logits before sampling.
    structured_output_rows: dict[int, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    # Speculative decoding with a draft model: ``seq_id -> k``, the drafts the worker proposes
    # after this step for each sampling sequence listed (set by the engine).
    draft_k: dict[int, int] = field(default_factory=dict)
    # Multi-LoRA: adapters to copy into device slots before the step (``slot -> LoRAAdapter``).
    lora_loads: dict[int, Any] = field(default_factory=dict)
    # KV transfer: this step's loads, saves and deletes (``None``: no connector, or nothing to do).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # The encoder cache (``core/encoder_cache_manager.py``): images to encode before the text model
    # runs, ``(mm_hash, encoder input)``, and entries the worker drops first.
    encoder_inputs: list[tuple[str, Any]] = field(default_factory=list)
    freed_encoder_hashes: list[str] = field(default_factory=list)
    # Multi-step decoding (``core/multi_step.py``): forward passes of this decode-only step, each
    # row fed the token it sampled in the pass before (slots for all of them are allocated).
    num_steps: int = 1

    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def scheduled_spec_decode_tokens(self) -> dict[int, list[int]]:
        """``seq_id -> drafts`` verified this step (vLLM's name)."""
        return {s.seq_id: s.spec_token_ids for s in self.scheduled if s.spec_token_ids}


@dataclass(slots=True)
class SampledToken:
    """The token sampled for one sequence, its log-probability, and the top-k if asked for."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, tuple[float, int]] | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens of one step, keyed by ``seq_id`` (only sequences with ``do_sample``).

    A sequence that verified drafts also has ``spec_accepted[seq_id]``: the drafts the rejection
    sampler accepted, in order; ``sampled[seq_id]`` is then the token after them (the target's
    correction at the first rejected draft, or the bonus token when all were accepted)."""

    sampled: dict[int, SampledToken]
    spec_accepted: dict[int, list[SampledToken]] = field(default_factory=dict)
    # A multi-step step's tokens before the last pass's (``sampled``), in order, per sequence.
    earlier_sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    # A draft model's proposals: ``seq_id -> (position of the last emitted token, drafts after it)``.
    draft_token_ids: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    # Seconds the runner spent preparing inputs, in the forward pass (the draft model's included)
    # and sampling (the step trace's phases).
    timings: tuple[float, float, float] = (0.0, 0.0, 0.0)
    encoder_seconds: float = 0.0  # the vision encoder's share of the preparation
    # ``SamplingParams.prompt_logprobs``: ``seq_id -> (position, entries)``, the entries of the
    # prompt tokens after ``position`` that this step computed (``token -> (logprob, rank)``).
    prompt_logprobs: dict[int, tuple[int, list[dict[int, tuple[float, int]]]]] = field(default_factory=dict)
    # runner="pooling": ``seq_id -> vector`` of each prompt whose last chunk ran this step.
    pooled: dict[int, list[float]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
