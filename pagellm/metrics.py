"""Typed engine statistics, defined once for the engine, data-parallel summing, the periodic log
line and Prometheus (vLLM V1's ``SchedulerStats`` / ``IterationStats``).

Each field carries how it is exported and merged across data-parallel replicas::

    field               kind     merge   Prometheus name (pagellm: prefix, model_name label)
    num_running         gauge    sum     num_requests_running
    kv_cache_usage      gauge    mean    kv_cache_usage_perc
    prompt_tokens       counter  sum     prompt_tokens(_total)
    ...

``EngineStats`` is also a read-only mapping of the flat names (``stats["num_running"]``), the
shape ``LLMEngine.get_stats()`` has always returned.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

GAUGE, COUNTER = "gauge", "counter"


def _stat(kind: str, doc: str, prom: str | None = None, merge: str = "sum", default: Any = 0) -> Any:
    return field(default=default, metadata={"kind": kind, "doc": doc, "prom": prom, "merge": merge})


@dataclass(slots=True)
class PrefixCacheStats:
    """Token-weighted prefix-cache counters: ``queries`` tokens looked up, ``hits`` found cached."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's queues and KV pools now, and its counters since start."""

    num_running: int = _stat(GAUGE, "Requests running", "num_requests_running")
    num_waiting: int = _stat(GAUGE, "Requests waiting", "num_requests_waiting")
    num_swapped: int = _stat(GAUGE, "Requests swapped out to CPU", "num_requests_swapped")
    kv_cache_usage: float = _stat(GAUGE, "Fraction of KV blocks in use", "kv_cache_usage_perc", "mean", 0.0)
    cpu_cache_usage: float = _stat(GAUGE, "Fraction of CPU swap blocks in use", "cpu_cache_usage_perc", "mean", 0.0)
    num_preemptions: int = _stat(COUNTER, "Preemptions (recompute or swap)", "num_preemptions")
    num_swap_outs: int = _stat(COUNTER, "Preemptions by swap", "num_swap_outs")
    num_swap_ins: int = _stat(COUNTER, "Swapped requests brought back")
    num_swap_fallbacks: int = _stat(COUNTER, "Swaps that found the CPU pool full and recomputed instead")
    prefix_cache_queries: int = _stat(COUNTER, "Prompt tokens looked up", "prefix_cache_queries")
    prefix_cache_hits: int = _stat(COUNTER, "Prompt tokens found cached", "prefix_cache_hits")
    num_waiting_for_fsm: int = _stat(GAUGE, "Requests waiting for their structured-output grammar to compile",
                                     "num_requests_waiting_for_fsm")
    num_constrained: int = _stat(GAUGE, "Requests decoding under a structured-output grammar",
                                 "num_requests_structured")
    lora_active: int = _stat(GAUGE, "LoRA adapters used by live requests", "lora_active_adapters")
    lora_registered: int = _stat(GAUGE, "LoRA adapters registered (checked, servable)", "lora_registered_adapters")
    num_loading_kv: int = _stat(GAUGE, "Requests waiting for a KV connector to load their prefix",
                                "num_requests_waiting_for_remote_kvs")
    kv_blocks_loaded: int = _stat(COUNTER, "KV blocks loaded by the KV connector", "kv_transfer_blocks_loaded")
    kv_blocks_saved: int = _stat(COUNTER, "KV blocks saved by the KV connector", "kv_transfer_blocks_saved")
    kv_bytes_loaded: int = _stat(COUNTER, "Bytes of K/V loaded by the KV connector", "kv_transfer_bytes_loaded")
    kv_bytes_saved: int = _stat(COUNTER, "Bytes of K/V saved by the KV connector", "kv_transfer_bytes_saved")
    kv_load_seconds: float = _stat(COUNTER, "Seconds the workers spent loading K/V", "kv_transfer_load_seconds",
                                   "sum", 0.0)
    kv_load_failures: int = _stat(COUNTER, "KV blocks a connector was asked for that did not arrive intact "
                                  "(recomputed, or the request failed)", "kv_transfer_load_failures")
    encoder_cache_usage: float = _stat(GAUGE, "Fraction of the encoder cache's rows held for running requests",
                                       "encoder_cache_usage_perc", "mean", 0.0)
    encoder_cache_hits: int = _stat(COUNTER, "Images whose encoder output was found cached", "encoder_cache_hits")
    encoder_cache_misses: int = _stat(COUNTER, "Images encoded", "encoder_cache_misses")

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(slots=True)
class IterationStats:
    """What the engine's steps computed since start (vLLM keeps one per step; these are the sums)."""

    steps: int = _stat(COUNTER, "Engine steps")
    prompt_tokens: int = _stat(COUNTER, "Prompt tokens computed", "prompt_tokens")
    generation_tokens: int = _stat(COUNTER, "Tokens generated", "generation_tokens")
    # Where each step's wall time goes, summed: the engine loop's own Python (scheduling; applying
    # outputs, detokenizing, stop checks, building RequestOutputs) against the workers' model time
    # (input preparation, forward, sampling; for several workers, until the last one answers).
    schedule_seconds: float = _stat(COUNTER, "Seconds in Scheduler.schedule", "step_schedule_seconds", "sum", 0.0)
    model_seconds: float = _stat(COUNTER, "Seconds waiting for the workers' model step", "step_model_seconds",
                                 "sum", 0.0)
    output_seconds: float = _stat(COUNTER, "Seconds applying a step's outputs (update, detokenize, stop checks)",
                                  "step_output_seconds", "sum", 0.0)
    encoder_seconds: float = _stat(COUNTER, "Seconds the vision encoder ran (inside the model time)",
                                   "encoder_seconds", "sum", 0.0)
    grammars_compiled: int = _stat(COUNTER, "Structured-output grammars compiled (cache hits included)",
                                   "structured_output_grammars")
    grammar_compile_seconds: float = _stat(COUNTER, "Seconds compiling structured-output grammars (off the step loop)",
                                           "structured_output_compile_seconds", "sum", 0.0)
    grammar_mask_seconds: float = _stat(COUNTER, "Seconds filling structured-output token bitmasks in steps",
                                        "structured_output_mask_seconds", "sum", 0.0)

    # Speculative decoding (vLLM's spec_decode_* counters; derived: acceptance rate, mean acceptance length).
    lora_loads: int = _stat(COUNTER, "LoRA adapters checked and registered", "lora_loads")
    lora_slot_loads: int = _stat(COUNTER, "LoRA adapters copied into a device slot (a slot's previous one evicted)",
                                 "lora_slot_loads")
    spec_num_drafts: int = _stat(COUNTER, "Draft runs verified (one per sequence and step with drafts)",
                                 "spec_decode_num_drafts")
    spec_num_draft_tokens: int = _stat(COUNTER, "Draft tokens verified", "spec_decode_num_draft_tokens")
    spec_num_accepted_tokens: int = _stat(COUNTER, "Draft tokens accepted", "spec_decode_num_accepted_tokens")
    spec_accepted_per_pos: list[int] = _stat(COUNTER, "Draft tokens accepted at each position (label position)",
                                             "spec_decode_num_accepted_tokens_per_pos", default=None)
    spec_steps_off: int = _stat(COUNTER, "Steps in which the cost model switched speculation off",
                                "spec_decode_steps_off")
    spec_k: int = _stat(GAUGE, "Drafts per sequence the cost model chose for the latest step", "spec_decode_k", "mean")

    def __post_init__(self) -> None:
        if self.spec_accepted_per_pos is None:
            self.spec_accepted_per_pos = []

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens per verified draft run, the target's own token included (vLLM's definition)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    def record_spec(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft_tokens
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def record_step(self, prompt_tokens: int, generation_tokens: int, schedule_seconds: float = 0.0,
                    model_seconds: float = 0.0, output_seconds: float = 0.0) -> None:
        self.steps += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.schedule_seconds += schedule_seconds
        self.model_seconds += model_seconds
        self.output_seconds += output_seconds


@dataclass(frozen=True, slots=True)
class StatField:
    """One flat statistic: where it lives and how it is exported and merged."""

    name: str
    group: str  # "scheduler" or "iteration"
    kind: str
    doc: str
    prom: str | None  # exported to Prometheus under this name, or not at all
    merge: str  # "sum" or "mean" over data-parallel replicas


STAT_FIELDS: tuple[StatField, ...] = tuple(
    StatField(f.name, group, f.metadata["kind"], f.metadata["doc"], f.metadata["prom"], f.metadata["merge"])
    for group, cls in (("scheduler", SchedulerStats), ("iteration", IterationStats)) for f in fields(cls))
_DERIVED = {"prefix_cache_hit_rate": "scheduler", "spec_acceptance_rate": "iteration",
            "spec_mean_acceptance_length": "iteration"}


@dataclass(slots=True)
class EngineStats(Mapping):
    """``SchedulerStats`` and ``IterationStats`` of one engine (or the sum over replicas)."""

    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    iteration: IterationStats = field(default_factory=IterationStats)

    def __getitem__(self, key: str) -> float:
        if key in _DERIVED:
            return getattr(getattr(self, _DERIVED[key]), key)
        for f in STAT_FIELDS:
            if f.name == key:
                return getattr(getattr(self, f.group), key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        yield from (f.name for f in STAT_FIELDS)
        yield from _DERIVED

    def __len__(self) -> int:
        return len(STAT_FIELDS) + len(_DERIVED)

    @classmethod
    def merge(cls, parts: list[EngineStats]) -> EngineStats:
        """Data-parallel replicas as one engine: counts and queues summed, pool usage averaged
        (the prefix-cache hit rate follows from the summed tokens)."""
        out = cls()
        for f in STAT_FIELDS:
            values = [getattr(getattr(p, f.group), f.name) for p in parts]
            if values and isinstance(values[0], list):  # per position: summed position by position
                width = max(len(v) for v in values)
                setattr(getattr(out, f.group), f.name,
                        [sum(v[i] for v in values if i < len(v)) for i in range(width)])
                continue
            total = sum(values) / len(values) if f.merge == "mean" and values else sum(values)
            setattr(getattr(out, f.group), f.name, total)
        return out
