"""``LLMEngine``: the step loop. tokenize -> schedule -> decorate -> execute -> update -> outputs.

Synchronous and single-threaded: ``step()`` runs exactly one scheduler step. Bad requests are
rejected with ``ValueError`` in ``add_request`` so they never reach (or stall) the scheduler. If a
worker fails, the step raises ``EngineDeadError``: every in-flight request is aborted (its blocks
freed), the workers are shut down and the engine refuses further work.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from pagellm.config import EngineArgs, EngineConfig, resolve_model_source
from pagellm.core.encoder_cache_manager import EncoderCacheManager
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_connector import (
    TcpConnectorScheduler,
    create_kv_connector,
)
from pagellm.core.kv_transfer_admission import KVTransferAdmission
from pagellm.core.scheduler import Scheduler
from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.engine.input_processor import InputProcessor, resolve_max_model_len
from pagellm.engine.kv_receiver import KVReceiver
from pagellm.engine.lora_manager import LoRAManager
from pagellm.engine.mm_processor import MultiModalProcessor
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.protocol import EngineDeadError, PromptType
from pagellm.engine.step_hooks import (
    KVTransferHook,
    LoRAHook,
    SpecDecodeHook,
    StepHook,
    StructuredOutputHook,
)
from pagellm.engine.step_trace import KVState, StepTimes, StepTracer, step_log_line, summarize_step
from pagellm.executor import PendingOutput, WorkerError, create_executor
from pagellm.lora_request import LoRARequest
from pagellm.metrics import EngineStats, IterationStats
from pagellm.outputs import RequestOutput
from pagellm.reasoning import ThinkTokens
from pagellm.sampling_params import SamplingParams
from pagellm.sequence import SequenceGroup, SequenceStatus
from pagellm.spec_decode.manager import SpecDecodeManager
from pagellm.structured_output.manager import StructuredOutputManager
from pagellm.tokenizer import Tokenizer
from pagellm.utils import gc_paused_then_frozen, gc_unfreeze

logger = logging.getLogger(__name__)



@dataclass(slots=True)
class StartedStep:
    """A step between ``begin_step`` and ``finish_step``: what was scheduled, the outputs already
    known (requests that can never fit), and the workers' pending result (``None``: nothing sent)."""

    scheduler_output: SchedulerOutput
    outputs: list[RequestOutput]
    pending: PendingOutput | None
    schedule_seconds: float = 0.0
    submitted_at: float = 0.0  # perf_counter when the workers got the step


def _encoder_config(config: EngineConfig, arch: str) -> EngineConfig:
    """An encoder's prompts attend both ways: each runs whole in one step (no chunked prefill), and
    none reuses another's K/V (no prefix caching), as vLLM runs encoder-only models."""
    sched, cache = config.scheduler, config.cache
    if sched.enable_chunked_prefill or cache.enable_prefix_caching:
        logger.info("%s is an encoder: chunked prefill and prefix caching are off", arch)
    return replace(config, scheduler=replace(sched, enable_chunked_prefill=False),
                   cache=replace(cache, enable_prefix_caching=False))


class LLMEngine:
    """The synchronous engine. ``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests``."""

    def __init__(self, config: EngineConfig, chat_template: str | None = None,
                 workers_per_machine: int | None = None, tokenizer: Tokenizer | None = None) -> None:
        """``workers_per_machine`` and ``tokenizer`` are for data-parallel replicas: how many
        workers share this machine's cores, and the tokenizer they share."""
        with gc_paused_then_frozen():  # the start-up heap, out of every later collection's walk
            self._start(config, chat_template, workers_per_machine, tokenizer)

    def _start(self, config: EngineConfig, chat_template: str | None, workers_per_machine: int | None,
               tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.source = resolve_model_source(config.model.model)
        self.dead_error: BaseException | None = None
        self.executor = create_executor(config, workers_per_machine)
        try:
            self.model_info = self.executor.load_model()
            self.num_blocks, self.num_cpu_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_cache(self.num_blocks, self.num_cpu_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start-up
            raise
        self.tokenizer = tokenizer or Tokenizer(self.source, config.model.tokenizer, chat_template)
        info = self.model_info
        if info.block_size and info.block_size != config.cache.block_size:  # (raised for a model's states)
            self.config = config = replace(config, cache=replace(config.cache, block_size=info.block_size))
        self.block_size = config.cache.block_size
        if info.is_encoder:
            self.config = config = _encoder_config(config, info.architecture)
        self.kv_cache_manager = KVCacheManager(self.num_blocks, self.block_size, config.cache.enable_prefix_caching,
                                               self.num_cpu_blocks, config.scheduler.watermark, info.kv_cache_config)
        capacity = self.kv_cache_manager.token_capacity(config.scheduler.max_num_batched_tokens)
        self.max_model_len = resolve_max_model_len(config, info.max_position_embeddings, capacity)
        mm_processor, encoder = self._multimodal(config) if info.is_multimodal else (None, None)
        self.input_processor = InputProcessor(config, self.tokenizer, info.vocab_size, self.max_model_len,
                                              capacity, mm_processor,
                                              min(encoder.budget, encoder.cache_size) if encoder else 0,
                                              info.end_of_generation_ids)
        lora = config.lora
        self.kv_receiver: KVReceiver | None = None
        kv_transfer = self._kv_transfer(config)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache_manager, max_model_len=self.max_model_len,
            num_lookahead_tokens=config.speculative.num_lookahead_tokens if config.speculative else 0,
            max_loras=lora.max_loras if lora.enable_lora else 0, kv_transfer=kv_transfer, encoder=encoder)
        self.lora: LoRAManager | None = None
        if lora.enable_lora:
            assert self.model_info.lora_module_shapes is not None
            self.lora = LoRAManager(lora.max_loras, lora.max_lora_rank, self.model_info.lora_module_shapes,
                                    self.model_info.num_layers)
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler.stream_interval,
                                                self.scheduler.finish_seq)
        # The batch queue: steps started and not finished yet (oldest first).
        self._max_batches = config.scheduler.max_concurrent_batches
        self._batch_queue: collections.deque[StartedStep] = collections.deque()
        self.iteration_stats = IterationStats()
        reasoning = config.structured_outputs.reasoning_parser  # (refused at start-up without the tags)
        self._think = None if reasoning is None else ThinkTokens.of(self.tokenizer.hf.get_vocab(), reasoning)
        obs = config.observability
        # The step trace and the per-step log line; None and False: nothing recorded, nothing paid.
        self.tracer = StepTracer(obs.trace_max_events, obs.trace_out) if obs.tracing else None
        self._log_steps = obs.log_step_details
        self.scheduler.record_decisions = obs.tracing or obs.log_step_details
        # (a module function, not a bound method: the engine must not be in a reference cycle,
        # which gc.freeze at start-up would keep alive with its weights and KV cache)
        self._spec = None if config.speculative is None else \
            SpecDecodeManager(config.speculative, self.iteration_stats, _under_grammar)
        cfg = config.structured_outputs
        # (the manager's arguments, not a bound method, for the same reason)
        self._structured = StructuredOutputHook(self.scheduler, functools.partial(
            StructuredOutputManager, self.tokenizer.hf, self.model_info.vocab_size, self.tokenizer.eos_token_id,
            cfg.backend, cfg.compile_timeout_s, self._think))
        self.hooks = self._step_hooks()
        self._log_start()

    def _step_hooks(self) -> list[StepHook]:
        """The features the configuration turned on (each built above from it), as what they add to
        each step (``engine/step_hooks.py``), in the order they run at each point."""
        hooks: list[StepHook] = [self._structured]
        if self.scheduler.kv_transfer is not None:
            hooks.append(KVTransferHook(self.scheduler, self.kv_receiver))
        if self.lora is not None:
            hooks.append(LoRAHook(self.lora))
        if self._spec is not None:
            draft_model = bool(self.scheduler.num_lookahead_tokens)  # (a draft model decides its counts per step)
            hooks.append(SpecDecodeHook(self._spec, self.scheduler, draft_model))
        return hooks

    def _log_start(self) -> None:
        info = self.model_info
        logger.info("pagellm engine: %s on %s (%s), %d KV blocks x %d tokens (+%d CPU swap blocks), "
                    "max_model_len %d", info.architecture, info.device, info.dtype,
                    self.num_blocks, self.block_size, self.num_cpu_blocks, self.max_model_len)
        kv_config = info.kv_cache_config
        if kv_config is not None and not kv_config.is_single_full:
            logger.info("KV cache: %s", kv_config.describe(info.block_bytes // self.block_size
                                                           // kv_config.layers_per_page))

    def _kv_transfer(self, config: EngineConfig) -> KVTransferAdmission | None:
        """The scheduler's side of KV transfer (and a TcpConnector consumer's receiver), if configured."""
        kvt = config.kv_transfer
        if kvt is None:
            return None
        connector = create_kv_connector(kvt, self.block_size, self.model_info.kv_fingerprint,
                                        self.model_info.block_bytes)
        if isinstance(connector, TcpConnectorScheduler):
            if connector.received is not None:
                extra = kvt.kv_connector_extra_config
                self.kv_receiver = KVReceiver(connector.received, extra.get("host", "127.0.0.1"), extra["port"])
            logger.info("KV transfer: TcpConnector (%s)%s", kvt.kv_role,
                        f", receiving at {self.kv_receiver.address}" if self.kv_receiver else "")
        return KVTransferAdmission(connector, self.kv_cache_manager, kvt.kv_load_failure_policy)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, chat_template: str | None = None) -> LLMEngine:
        return cls(engine_args.create_engine_config(), chat_template)

    # ------------------------------------------------------------------ requests
    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The structured-output manager (created on first use)."""
        return self._structured.get_manager()

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of any accepted prompt form."""
        return self.input_processor.tokenize_prompt(prompt)

    def _multimodal(self, config: EngineConfig) -> tuple[MultiModalProcessor, EncoderCacheManager]:
        """A vision-language model's image processing and encoder cache; vLLM's defaults for the
        cache and the budget: room for the largest image the processor makes, at least a step's tokens."""
        mm = config.multimodal
        processor = MultiModalProcessor(self.source.path, mm)
        default = max(config.scheduler.max_num_batched_tokens, processor.max_tokens_per_image())
        self.tokenizer.image_placeholder = processor.placeholder
        encoder = EncoderCacheManager(mm.encoder_cache_size or default, mm.max_num_encoder_input_tokens or default)
        return processor, encoder

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; raises ``ValueError`` naming the problem instead of queueing it.

        ``cache_salt``: requests share cached prefix blocks only with requests of the same salt.
        ``lora_request``: the adapter it runs with (checked and registered on first use).
        """
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead ({self.dead_error}); request {request_id!r} refused")
        pooling = self.model_info.pooling
        if pooling is not None:  # (a pooling request computes its prompt and samples nothing)
            params = SamplingParams(max_tokens=1, temperature=0)
        group = self.input_processor.process(request_id, prompt, params, self.scheduler.new_seq_id, arrival_time,
                                             priority, cache_salt)
        if self.get_request_group(request_id) is not None:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group.pooling = pooling.pooling_type if pooling is not None else None
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request needs an engine with enable_lora=True")
            adapter = self.lora.acquire(lora_request)
            group.lora_id, group.lora_fingerprint = lora_request.lora_int_id, adapter.fingerprint
        self.output_processor.add_request(group)
        if self.tracer is not None:
            self.tracer.request_added(request_id, len(group.prompt_token_ids))
        try:
            if not any(hook.take_request(group) for hook in self.hooks):  # (held: before_schedule admits it)
                self.scheduler.add_request(group)
        except BaseException:
            if group.lora_id and self.lora is not None:
                self.lora.release(group.lora_id)
            self.output_processor.forget(group)
            raise

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check and register an adapter ahead of its requests (``ValueError`` if it cannot be served)."""
        if self.lora is None:
            raise ValueError("add_lora needs an engine with enable_lora=True")
        self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; refuses (``LoRAInUse``, a ``ValueError``) while requests use it."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest] | None:
        """The registered adapters (``None``: the engine runs without LoRA)."""
        return None if self.lora is None else list(self.lora.requests.values())

    def get_request_group(self, request_id: str) -> SequenceGroup | None:
        """A queued or running request's state (also while it waits for its grammar), or ``None``."""
        group = self.scheduler.requests.get(request_id)
        if group is None:
            group = next((g for hook in self.hooks if (g := hook.held_request(request_id)) is not None), None)
        return group

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            for hook in self.hooks:
                held = hook.abort_held(rid)
                if held is not None:
                    self._forget(held)
        for group in self.scheduler.finish_requests(request_id, SequenceStatus.FINISHED_ABORTED):
            self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue) or self._num_held() > 0

    def _num_held(self) -> int:
        return sum(hook.num_held for hook in self.hooks)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only possible while no request holds blocks (returns success)."""
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        """Queues, KV usage, preemptions, prefix-cache counters, tokens and steps (``pagellm.metrics``;
        also readable as a mapping, ``stats["num_running"]``)."""
        sched, it = self.scheduler.make_stats(), replace(self.iteration_stats)
        it.spec_accepted_per_pos = list(it.spec_accepted_per_pos)  # a snapshot, not the live list
        for hook in self.hooks:
            hook.add_stats(sched, it)
        return EngineStats(sched, it)

    @property
    def stats(self) -> EngineStats:
        return self.get_stats()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests() + self._num_held()

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine or any of its workers has failed."""
        if self.dead_error is None:
            try:
                self.executor.check_health()
            except WorkerError as e:
                self._die(e)
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")

    def shutdown(self) -> None:
        """Stop the workers (processes or Ray actors); idempotent."""
        for hook in self.hooks:
            hook.shutdown()
        if self.tracer is not None and self.tracer.path is not None:
            try:
                self.write_trace()
            except OSError as e:  # a full disk must not keep the workers alive
                logger.warning("could not write the step trace: %s", e)
        self.executor.shutdown()
        gc_unfreeze()

    def _die(self, error: BaseException) -> EngineDeadError:
        """Fail every in-flight request (blocks freed), stop the workers, refuse further work."""
        self.dead_error = error
        self._batch_queue.clear()
        groups = self.scheduler.finish_requests(list(self.scheduler.requests), SequenceStatus.FINISHED_ABORTED)
        for hook in self.hooks:
            groups += [g for g in hook.held_requests() if hook.abort_held(g.request_id)]
        for group in groups:
            self._forget(group)
        logger.error("engine failed, %d in-flight request(s) aborted: %s", len(groups), error)
        self.executor.shutdown()
        return EngineDeadError(f"the engine died: {error}")

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the outputs of requests that got a token or finished.

        With a batch queue (``max_concurrent_batches`` > 1: pipeline stages, async scheduling)
        this first schedules and starts steps until that many are in flight (or nothing more can
        be scheduled), then waits for the oldest: the workers compute one step while the engine
        schedules the next and applies the last one's outputs."""
        if self._max_batches == 1:
            return self.finish_step(self.begin_step())
        outputs: list[RequestOutput] = []
        while len(self._batch_queue) < self._max_batches:
            started = self.begin_step()
            if started.pending is None:  # nothing (more) to run now
                outputs += self.finish_step(started)
                break
            self._batch_queue.append(started)
        if self._batch_queue:
            outputs += self.finish_step(self._batch_queue.popleft())
        return outputs

    def begin_step(self) -> StartedStep:
        """Schedule and start the step on the workers without waiting (``finish_step`` waits);
        several engines (data-parallel replicas) can so compute at the same time."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        t0 = time.perf_counter()
        outputs = [self._finish_early(group, error) for hook in self.hooks for group, error in hook.before_schedule()]
        sched_out = self.scheduler.schedule()
        ignored = self.scheduler.take_ignored()
        outputs += [self._finish_ignored(g) for g in ignored]
        for hook in self.hooks:
            hook.decorate_step(sched_out, self.scheduler.requests)
        # An empty step still goes to the workers when they must drop finished sequences' state,
        # do swap-outs or move K/V for a connector.
        if sched_out.is_empty() and not sched_out.finished_seq_ids and sched_out.cache_ops.is_empty() \
                and sched_out.kv_connector_metadata is None:
            if self.scheduler.num_waiting_for_remote and not outputs:
                time.sleep(0.002)  # only requests waiting for K/V from another engine: do not spin
            return StartedStep(sched_out, outputs, None)
        t1 = time.perf_counter()
        try:
            return StartedStep(sched_out, outputs, self.executor.submit_model(sched_out), t1 - t0, t1)
        except WorkerError as e:
            raise self._die(e) from e

    def finish_step(self, started: StartedStep) -> list[RequestOutput]:
        """Wait for the step ``begin_step`` started; update sequences; return the outputs."""
        sched_out, outputs = started.scheduler_output, started.outputs
        if started.pending is None:
            return outputs
        try:
            runner_out = started.pending.result()
        except WorkerError as e:
            raise self._die(e) from e
        t_model = time.perf_counter()
        for hook in self.hooks:  # (before the update, which releases the requests that finish)
            ended = hook.after_model(sched_out, runner_out, t_model - started.submitted_at)
            outputs += [self._finish_early(group, error) for group, error in ended]
        if sched_out.is_empty():
            return outputs
        prompt_tokens = sum(max(0, min(s.num_computed_tokens + s.num_scheduled_tokens, len(s.prompt_token_ids))
                                - s.num_computed_tokens) for s in sched_out.scheduled)
        num_accepted = sum(map(len, runner_out.spec_accepted.values()))  # (verified drafts' accepted tokens)
        updated, finished = self.scheduler.update_from_output(sched_out, runner_out)
        for hook in self.hooks:
            hook.after_update(updated)
        outputs += self.output_processor.process(updated)
        for group in updated:
            if group.is_finished():
                self._forget(group)
        for hook in self.hooks:
            hook.after_outputs(runner_out)
        t_end = time.perf_counter()
        self.iteration_stats.encoder_seconds += runner_out.encoder_seconds
        num_earlier = sum(map(len, runner_out.earlier_sampled.values()))  # (multi-step's earlier passes)
        self.iteration_stats.record_step(prompt_tokens, len(runner_out.sampled) + num_accepted + num_earlier,
                                         started.schedule_seconds, t_model - started.submitted_at, t_end - t_model)
        if self.scheduler.record_decisions:
            self._trace_step(started, runner_out.timings, t_model, t_end)
        return outputs

    def _trace_step(self, started: StartedStep, timings: tuple[float, float, float], t_model: float,
                    t_end: float) -> None:
        """The step into the trace and/or the per-step log line."""
        kv = self.kv_cache_manager
        times = StepTimes(started.submitted_at - started.schedule_seconds, started.schedule_seconds,
                          started.submitted_at, *timings, t_model, t_end)
        state = KVState(kv.num_blocks, kv.num_free_blocks, len(kv.block_pool.cached_block_hash_to_block))
        stats = self.scheduler.make_stats()
        args = (started.scheduler_output, self.scheduler.last_decisions, stats, state,
                self.config.scheduler.max_num_batched_tokens)
        if self.tracer is not None:
            summary = self.tracer.record_step(times, *args)
        else:
            summary = summarize_step(self.iteration_stats.steps, *args)
        if self._log_steps:
            logger.info("%s", step_log_line(summary, times))

    def get_trace(self) -> dict[str, Any] | None:
        """The step trace's buffer as a Chrome Trace document (``None`` when tracing is off)."""
        return self.tracer.to_json() if self.tracer is not None else None

    def write_trace(self) -> str | None:
        """Write the step trace to its ``trace_out`` file (if any); returns the path."""
        return self.tracer.write() if self.tracer is not None else None

    def _finish_ignored(self, group: SequenceGroup) -> RequestOutput:
        logger.warning("request %s needs more KV blocks than the whole pool holds (%d x %d tokens); "
                       "finished without completing", group.request_id, self.num_blocks, self.block_size)
        return self._finish_early(group)

    def _finish_early(self, group: SequenceGroup, error: str | None = None) -> RequestOutput:
        """The final output of a request that ended outside a step's output (its sequences' status
        already set), with ``error`` when it was not served; the engine forgets it."""
        group.metrics.finished_time = time.monotonic()
        out = self.output_processor.make_output(group)
        out.error = error
        self._forget(group)
        return out

    def _forget(self, group: SequenceGroup) -> None:
        if self.tracer is not None:
            self.tracer.request_finished(group.request_id, group.seqs[0].status.finish_reason,
                                         sum(s.num_output_tokens for s in group.seqs))
        self.output_processor.forget(group)
        for hook in self.hooks:
            hook.request_finished(group)


def _under_grammar(group: SequenceGroup) -> bool:
    """Requests under a grammar decode without drafts (each draft would need its own mask)."""
    return group.sampling_params.structured_outputs is not None
