"""Request state: ``Sequence`` (one token stream) and ``SequenceGroup`` (one request).

A sequence's tokens are ``prompt_token_ids + output_token_ids``. ``num_computed_tokens`` counts
the leading tokens whose K/V are in the cache; the scheduler's only question each step is how many
of the remaining ``num_tokens - num_computed_tokens`` to compute next (ARCHITECTURE rule 1)::

    |<------------------- num_tokens ------------------->|
    | computed (K/V cached)  | scheduled this step | rest |
    0               num_computed_tokens
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagellm.beam_state import BeamSearchState
from pagellm.mm_inputs import BlockKeys, MultiModalFeature
from pagellm.outputs import RequestMetrics
from pagellm.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Life cycle of a sequence; every status after ``PREEMPTED`` is a finished one."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2  # preempted by swap: its K/V wait in the CPU swap pool
    PREEMPTED = 3  # preempted by recompute: back in the waiting queue, K/V dropped
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    # Could never be scheduled (needs more KV blocks than the whole pool): vLLM's "ignored".
    FINISHED_IGNORED = 7

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",  # as in vLLM: it ran out of room
}


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens and how much of it has K/V in the cache."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    # One dict per generated token when logprobs were requested: token id -> (logprob, rank).
    output_logprobs: list[dict[int, tuple[float, int]]] = field(default_factory=list)
    stop_reason: int | str | None = None
    # Chained hashes of this sequence's full blocks, extended by the KV cache manager as it grows.
    block_hashes: list[bytes] = field(default_factory=list)
    # Speculative decoding: the proposer's guesses at the next tokens, verified in the next step
    # (only a sequence in the decode state, ``num_computed_tokens == num_tokens - 1``, uses them).
    spec_token_ids: list[int] = field(default_factory=list)
    # This step's run of accepted drafts (a request with stop strings): the cumulative logprob before
    # each of its tokens, which begin at output ``run_start``; what ``truncate_output`` goes back to.
    run_start: int = 0
    run_cumulative: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the full list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_token(self, token_id: int, logprob: float, top: dict[int, tuple[float, int]] | None) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top is not None:
            self.output_logprobs.append(top)

    def truncate_output(self, keep: int) -> None:
        """Keep the first ``keep`` output tokens, cutting into this step's run (a stop string that
        ends inside it): the cumulative logprob is the one recorded before token ``keep``, bit for
        bit what it was when the run had only reached it."""
        i = keep - self.run_start
        if not 0 < i < len(self.run_cumulative):
            raise ValueError(f"keep={keep} is not inside this step's run of {len(self.run_cumulative)} tokens "
                             f"from output {self.run_start}")
        self.cumulative_logprob = self.run_cumulative[i]
        del self.output_token_ids[keep:]
        del self.output_logprobs[keep:]

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the K/V are dropped, the tokens are kept and recomputed later."""
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.status = SequenceStatus.PREEMPTED

    def is_finished(self) -> bool:
        return self.status.is_finished

    def fork(self, seq_id: int) -> Sequence:
        """A child with this sequence's tokens and progress (its blocks are shared by the KV manager)."""
        return Sequence(seq_id, self.prompt_token_ids, list(self.output_token_ids), self.num_computed_tokens,
                        self.status, self.cumulative_logprob, list(self.output_logprobs), self.stop_reason,
                        list(self.block_hashes))


@dataclass(slots=True)
class KVTransferState:
    """A request's part in KV transfer (``core/kv_transfer_admission.py``)."""

    # vLLM's ``kv_transfer_params`` (disaggregated prefill/decode; ``core/kv_connector.py``).
    params: dict[str, Any] | None = None
    load_tried: bool = False  # a connector load was tried (at most once per request)
    timed_out: bool = False  # pushed K/V did not arrive in time: recompute what is missing


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request: its sequences (one, then ``n`` / ``best_of`` after the prompt), params,
    priority and timing. Sequences are only added (forks), never removed: ``seqs[i]`` is
    completion ``i`` for the whole life of the request."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    # Prompt tokens found in the prefix cache at first admission (reported in RequestOutput).
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(init=False)
    # Set by the scheduler: arrival order (ties of ``priority``), and for priority aging the
    # engine steps spent queued (waiting or swapped) before the current stay, and the step the
    # current stay began (``None`` while running).
    arrival_index: int = 0
    steps_queued: int = 0
    queued_since: int | None = None
    # Parallel sampling: the prompt's one sequence forks into ``num_samples`` at its first sample.
    forked: bool = False
    # Beam search: the search's state (``None``: sampling or greedy).
    beam_state: BeamSearchState | None = None
    # Multi-LoRA: the adapter's ``lora_int_id`` (0: the base model) and its weights' fingerprint,
    # which goes into the prefix cache's block hashes.
    lora_id: int = 0
    lora_fingerprint: str | None = None
    kv_transfer: KVTransferState = field(default_factory=lambda: KVTransferState())
    # Images, in prompt order (``mm_inputs.py``), and the indices of those whose encoder output
    # this request holds in the encoder cache (``core/encoder_cache_manager.py``).
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    encoder_refs: set[int] = field(default_factory=set)
    # ``SamplingParams.prompt_logprobs``: per prompt position, the token there and the top-k, each
    # ``token -> (logprob, rank)`` given the tokens before it (position 0 has none).
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    # runner="pooling": the pooling type (the request embeds its prompt and samples nothing), and
    # the vector once its last chunk ran.
    pooling: str | None = None
    pooled: list[float] | None = None

    @property
    def hash_key(self) -> str | BlockKeys | None:
        """What the block hashes include besides tokens: in the first block's, the cache salt and the
        adapter's weights (K/V computed under one adapter are never another's, or the base model's);
        with images, each image's hash from the block where it starts (the same placeholder tokens
        over another image are other K/V): ``BlockKeys``."""
        key = self.cache_salt
        if self.lora_fingerprint is not None:
            key = f"{key or ''}\x00lora:{self.lora_fingerprint}"
        if self.mm_features:
            return BlockKeys(key, tuple((f.offset, f.end, f.mm_hash) for f in self.mm_features))
        return key

    @property
    def num_samples(self) -> int:
        """Sequences this request will have: ``best_of`` (>= n) or ``n``."""
        return self.sampling_params.best_of or self.sampling_params.n

    @property
    def num_seqs_reserved(self) -> int:
        """Sequences this request counts against ``max_num_seqs``: its live ones, or all it will
        fork; a beam search always its beam width."""
        if self.beam_state is not None:
            return self.beam_state.beam_width
        return len(self.live_seqs()) if self.forked else self.num_samples

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    def record_prompt_logprobs(self, first: int, entries: list[dict[int, tuple[float, int]]]) -> None:
        """The entries of prompt positions ``first + 1 ...`` (a prompt computed again after a
        preemption brings them twice: the first are kept)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        for i, entry in enumerate(entries, first + 1):
            if self.prompt_logprobs[i] is None:
                self.prompt_logprobs[i] = entry

    @property
    def prompt_logprobs_done(self) -> bool:
        """Whether every prompt position after the first has its entry (a one-token prompt has none
        to score)."""
        if self.prompt_logprobs is None:
            return self.sampling_params.prompt_logprobs is not None and len(self.prompt_token_ids) == 1
        return all(e is not None for e in self.prompt_logprobs[1:])

    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)
