"""Data parallelism: ``data_parallel_size`` independent engine replicas behind one engine API.

Each replica is a whole ``LLMEngine`` (its own scheduler, KV cache manager and workers, which may
themselves be tensor parallel). A new request goes to the replica with the fewest outstanding
tokens (prompt tokens plus the most it may still generate, over its unfinished requests), less
the tokens of its prompt that replica already holds in its prefix cache: a replica that cached a
request's system prompt gets the next request with that prompt unless it is busier by more than
the prefix is worth. One
``step`` starts a step on every busy replica before waiting for any, so the replicas' workers
compute at the same time. A replica that fails takes the whole engine down: every in-flight
request, on every replica, ends with ``EngineDeadError``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from pagellm.config import EngineArgs, EngineConfig, resolve_model_source
from pagellm.engine.llm_engine import LLMEngine, StartedStep
from pagellm.engine.protocol import EngineDeadError, PromptType
from pagellm.engine.step_trace import write_trace_json
from pagellm.lora_request import LoRARequest
from pagellm.metrics import EngineStats
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.sequence import Sequence
from pagellm.structured_output.manager import StructuredOutputManager
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class DataParallelEngine:
    """``LLMEngine``'s public API over N replicas, balanced by least outstanding tokens."""

    def __init__(self, config: EngineConfig, chat_template: str | None = None) -> None:
        par = config.parallel
        self.config = config
        # Replicas trace in memory; this engine writes their traces as one file (a process per replica).
        replica = replace(config, parallel=replace(par, data_parallel_size=1),
                          observability=replace(config.observability, trace=config.observability.tracing,
                                                trace_out=None))
        # One tokenizer for all, loaded here: transformers' lazy imports are not thread-safe.
        tokenizer = Tokenizer(resolve_model_source(config.model.model), config.model.tokenizer, chat_template)
        # Replicas start in parallel (their workers load the model at the same time).
        with ThreadPoolExecutor(par.data_parallel_size) as pool:
            futures = [pool.submit(LLMEngine, replica, chat_template, par.world_size, tokenizer)
                       for _ in range(par.data_parallel_size)]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for f in futures:
                if f.exception() is None:
                    f.result().shutdown()
            raise errors[0]  # type: ignore[misc]
        self.replicas: list[LLMEngine] = [f.result() for f in futures]
        first = self.replicas[0]
        self.tokenizer, self.model_info, self.max_model_len = first.tokenizer, first.model_info, first.max_model_len
        self._replica_of: dict[str, int] = {}
        self._cost: dict[str, int] = {}
        self.outstanding = [0] * len(self.replicas)  # tokens per replica, for routing
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, chat_template: str | None = None) -> DataParallelEngine:
        return cls(engine_args.create_engine_config(), chat_template)

    # ------------------------------------------------------------------ requests
    def get_tokenizer(self):
        return self.tokenizer

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The first replica's manager, for front ends that check a constraint before queueing
        (each replica compiles the requests routed to it)."""
        return self.replicas[0].structured_outputs

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        if request_id in self._replica_of:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        text, ids = self.replicas[0].tokenize_prompt(prompt)  # once, not once per replica
        i = self._route(ids, cache_salt)
        replica = self.replicas[i]
        replica.add_request(request_id, {"prompt": text, "prompt_token_ids": ids}, params, arrival_time, priority,
                            cache_salt, lora_request)
        group = replica.get_request_group(request_id)
        assert group is not None
        max_new = group.sampling_params.max_tokens or (self.max_model_len - len(group.prompt_token_ids))
        cost = len(group.prompt_token_ids) + (group.sampling_params.best_of or group.sampling_params.n) * max_new
        self._replica_of[request_id], self._cost[request_id] = i, cost
        self.outstanding[i] += cost

    def _route(self, ids: list[int], cache_salt: str | None) -> int:
        """The replica with the least outstanding tokens once its cached prefix of ``ids`` is
        counted as done (ties: the lowest index). The lookup only reads the replicas' caches."""
        probe = Sequence(-1, ids)  # its block hashes are computed once and reused for every replica
        cached = [len(r.kv_cache_manager.get_computed_blocks(probe, cache_salt)) * r.block_size if ids else 0
                  for r in self.replicas]
        return min(range(len(self.replicas)), key=lambda i: self.outstanding[i] - cached[i])

    def _release(self, request_id: str) -> None:
        i = self._replica_of.pop(request_id, None)
        if i is not None:
            self.outstanding[i] -= self._cost.pop(request_id)

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            i = self._replica_of.get(rid)
            if i is not None:
                self.replicas[i].abort_request(rid)
                self._release(rid)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        return all([r.reset_prefix_cache() for r in self.replicas])

    def get_stats(self) -> EngineStats:
        """The replicas' stats as one engine's (``EngineStats.merge``)."""
        return EngineStats.merge([r.get_stats() for r in self.replicas])

    @property
    def stats(self) -> EngineStats:
        return self.get_stats()

    # ------------------------------------------------------------------ steps
    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, computed concurrently."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        started: list[tuple[LLMEngine, StartedStep]] = []
        outputs: list[RequestOutput] = []
        try:
            for r in self.replicas:
                started.append((r, r.begin_step()))
            for r, s in started:
                outputs += r.finish_step(s)
        except EngineDeadError as e:
            raise self._die(e) from e
        for out in outputs:
            if out.finished:
                self._release(out.request_id)
        return outputs

    def _die(self, error: BaseException) -> EngineDeadError:
        self.dead_error = error
        for r in self.replicas:
            if r.dead_error is None:
                r._die(RuntimeError(f"another data-parallel replica failed: {error}"))
        self._replica_of.clear()
        self._cost.clear()
        self.outstanding = [0] * len(self.replicas)
        return EngineDeadError(f"the engine died: {error}")

    def check_health(self) -> None:
        try:
            for r in self.replicas:
                r.check_health()
        except EngineDeadError as e:
            if self.dead_error is None:
                self._die(e)
            raise

    def add_lora(self, lora_request: LoRARequest) -> None:
        for r in self.replicas:
            r.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return all([r.remove_lora(lora_int_id) for r in self.replicas])

    def list_loras(self) -> list[LoRARequest] | None:
        return self.replicas[0].list_loras()

    def get_trace(self) -> dict[str, Any] | None:
        """The replicas' step traces as one document, replica ``i`` as process ``i + 1``."""
        traces = [r.get_trace() for r in self.replicas]
        if traces[0] is None:
            return None
        events = []
        for i, t in enumerate(traces):
            assert t is not None
            for ev in t["traceEvents"]:
                ev = dict(ev, pid=i + 1)
                if ev.get("name") == "process_name":
                    ev["args"] = {"name": f"pagellm engine (data-parallel replica {i})"}
                events.append(ev)
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"producer": "pagellm", "replicas": len(traces)}}

    def write_trace(self) -> str | None:
        path = self.config.observability.trace_out
        trace = self.get_trace()
        if path is None or trace is None:
            return None
        return write_trace_json(trace, path)

    def shutdown(self) -> None:
        if self.config.observability.trace_out is not None:
            self.write_trace()
        for r in self.replicas:
            r.shutdown()


def create_engine(engine_args: EngineArgs, chat_template: str | None = None) -> LLMEngine | DataParallelEngine:
    """An ``LLMEngine``, or a ``DataParallelEngine`` of them when ``data_parallel_size > 1``."""
    config = engine_args.create_engine_config()
    if config.parallel.data_parallel_size > 1:
        return DataParallelEngine(config, chat_template)
    return LLMEngine(config, chat_template)
