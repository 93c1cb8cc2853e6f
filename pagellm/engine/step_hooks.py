"""What a feature adds to the engine's step and to its requests' lives: one ``StepHook`` per feature.

``LLMEngine`` calls every hook at fixed points, in registration order, and names no feature:

    take_request      a new request: a hook may hold it back from the scheduler (a grammar compiling)
    before_schedule   held requests join the scheduler (or end with an error)
    decorate_step     after the scheduler decided the step: what the workers need (masks, slots, drafts)
    after_model       the workers' output, before the scheduler applies it (draft statistics, K/V loads)
    after_update      the updated requests, before their outputs are made (grammars advance)
    after_outputs     the step is done (the next step's drafts)
    request_finished  a request left the engine (its state freed)

Structured output, speculative decoding, KV transfer and LoRA are the hooks below, registered from
the config (``LLMEngine._step_hooks``); a new feature is one more ``StepHook`` and its line there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from pagellm.sequence import SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from pagellm.core.scheduler import Scheduler
    from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagellm.engine.kv_receiver import KVReceiver
    from pagellm.engine.lora_manager import LoRAManager
    from pagellm.metrics import IterationStats, SchedulerStats
    from pagellm.spec_decode.manager import SpecDecodeManager
    from pagellm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# A request that ends outside a step's outputs, with the reason (the engine makes its final output).
EndedEarly = tuple[SequenceGroup, str]


class StepHook:
    """One feature's part in the step (see the module's docstring); every point is a no-op here."""

    def take_request(self, group: SequenceGroup) -> bool:
        """Whether this hook holds the new request back from the scheduler (it hands it over in
        ``before_schedule``)."""
        return False

    def held_request(self, request_id: str) -> SequenceGroup | None:
        return None

    def held_requests(self) -> list[SequenceGroup]:
        return []

    def abort_held(self, request_id: str) -> SequenceGroup | None:
        """Drop a held request (``None``: not held here)."""
        return None

    @property
    def num_held(self) -> int:
        return 0

    def before_schedule(self) -> list[EndedEarly]:
        return []

    def decorate_step(self, so: SchedulerOutput, requests: Mapping[str, SequenceGroup]) -> None:
        """Add this feature's part to ``so`` (``requests``: the scheduler's requests by id)."""

    def after_model(self, so: SchedulerOutput, out: ModelRunnerOutput, model_seconds: float) -> list[EndedEarly]:
        return []

    def after_update(self, updated: list[SequenceGroup]) -> None:
        pass

    def after_outputs(self, out: ModelRunnerOutput) -> None:
        pass

    def request_finished(self, group: SequenceGroup) -> None:
        pass

    def add_stats(self, sched: SchedulerStats, it: IterationStats) -> None:
        pass

    def shutdown(self) -> None:
        pass


class LoRAHook(StepHook):
    """Adapter slots per step; an adapter is released with the last request that uses it."""

    def __init__(self, lora: LoRAManager) -> None:
        self.lora = lora

    def decorate_step(self, so: SchedulerOutput, requests: Mapping[str, SequenceGroup]) -> None:
        self.lora.decorate_step(so, requests)

    def request_finished(self, group: SequenceGroup) -> None:
        if group.lora_id:
            self.lora.release(group.lora_id)

    def add_stats(self, sched: SchedulerStats, it: IterationStats) -> None:
        sched.lora_active, sched.lora_registered = self.lora.num_active, len(self.lora.requests)
        it.lora_loads, it.lora_slot_loads = self.lora.stats.loads, self.lora.stats.slot_loads


class StructuredOutputHook(StepHook):
    """Constrained requests wait outside the scheduler until their grammar compiles; each step
    fills their masks and feeds their new tokens to their matchers. The manager (and a grammar
    library) is built on the first constrained request: an engine that never sees one imports none."""

    def __init__(self, scheduler: Scheduler, build: Callable[[], StructuredOutputManager]) -> None:
        self.scheduler = scheduler
        self._build = build
        self.manager: StructuredOutputManager | None = None

    def get_manager(self) -> StructuredOutputManager:
        if self.manager is None:
            self.manager = self._build()
        return self.manager

    def take_request(self, group: SequenceGroup) -> bool:
        if group.sampling_params.structured_outputs is None:
            return False
        self.get_manager().add_request(group)  # waits for its grammar (WAITING_FOR_FSM)
        return True

    def held_request(self, request_id: str) -> SequenceGroup | None:
        return None if self.manager is None else self.manager.pending_group(request_id)

    def held_requests(self) -> list[SequenceGroup]:
        return [] if self.manager is None else self.manager.pending_groups()

    def abort_held(self, request_id: str) -> SequenceGroup | None:
        return None if self.manager is None else self.manager.abort(request_id)

    @property
    def num_held(self) -> int:
        return 0 if self.manager is None else self.manager.num_waiting_for_fsm

    def before_schedule(self) -> list[EndedEarly]:
        """Requests whose grammar compiled join the scheduler; those that failed end with the error."""
        so = self.manager
        if so is None:
            return []
        ready, failed = so.take_ready()
        for group in ready:
            self.scheduler.add_request(group)
        for group, error in failed:
            logger.warning("request %s: %s", group.request_id, error)
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_ABORTED
        if not ready and not failed and so.num_waiting_for_fsm and not self.scheduler.has_unfinished_requests():
            so.wait_any(0.005)  # nothing else to run: wait for a compile instead of spinning
        return failed

    def decorate_step(self, so: SchedulerOutput, requests: Mapping[str, SequenceGroup]) -> None:
        if self.manager is not None:
            self.manager.decorate_step(so, requests)

    def after_update(self, updated: list[SequenceGroup]) -> None:
        """Each constrained sequence's new token into its matcher; a complete grammar ends it."""
        so = self.manager
        if so is None or not so.num_constrained:
            return
        for group in updated:
            if not so.is_constrained(group.request_id):
                continue
            for seq in group.seqs:
                if seq.status.is_finished:
                    continue
                state = so.advance(group.request_id, seq)
                if state == "rejected":
                    logger.warning("request %s: the grammar refused a sampled token; ending the sequence",
                                   group.request_id)
                # A beam search ends its beams itself (the complete grammar leaves only EOS to pick).
                if state is not None and group.beam_state is None:
                    self.scheduler.finish_seq(group, seq, SequenceStatus.FINISHED_STOPPED)

    def request_finished(self, group: SequenceGroup) -> None:
        if self.manager is not None:
            self.manager.forget(group)

    def add_stats(self, sched: SchedulerStats, it: IterationStats) -> None:
        so = self.manager
        if so is None:
            return
        sched.num_waiting_for_fsm = so.num_waiting_for_fsm
        sched.num_constrained = so.num_constrained
        it.grammar_compile_seconds = so.stats.compile_seconds
        it.grammar_mask_seconds = so.stats.mask_seconds
        it.grammars_compiled = so.stats.grammars_compiled

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()


class SpecDecodeHook(StepHook):
    """Drafts proposed after each step, verified in the next; a draft model decides its draft
    counts per step (``decorate_step``) and computes them during it."""

    def __init__(self, spec: SpecDecodeManager, scheduler: Scheduler, draft_model: bool) -> None:
        self.spec, self.scheduler, self.draft_model = spec, scheduler, draft_model

    def decorate_step(self, so: SchedulerOutput, requests: Mapping[str, SequenceGroup]) -> None:
        if self.draft_model:
            self.spec.decorate_step(so, requests)

    def after_model(self, so: SchedulerOutput, out: ModelRunnerOutput, model_seconds: float) -> list[EndedEarly]:
        """Each verified run into the statistics (before the update, which releases the requests
        that finish); a step of decodes into the draft cost model."""
        if so.is_empty():
            return []
        for s in so.scheduled:
            group = self.scheduler.requests.get(s.request_id)
            if s.spec_token_ids and group is not None:
                self.spec.record(group, s.seq_id, len(s.spec_token_ids), len(out.spec_accepted.get(s.seq_id, ())),
                                 self.spec.stats)
        if all(s.is_decode or s.spec_token_ids for s in so.scheduled):  # (a prefill costs otherwise)
            self.spec.observe_step(sum(s.num_scheduled_tokens for s in so.scheduled), model_seconds)
        return []

    def after_outputs(self, out: ModelRunnerOutput) -> None:
        self.spec.receive_model_drafts(out.draft_token_ids)
        self.spec.propose(self.scheduler.running)

    def request_finished(self, group: SequenceGroup) -> None:
        self.spec.request_finished(group)


class KVTransferHook(StepHook):
    """The connector's finished loads and saves applied after each step; a load that failed under
    ``kv_load_failure_policy='fail'`` ends its request."""

    LOAD_FAILED = "its cached prefix could not be loaded by the KV connector (kv_load_failure_policy 'fail')"

    def __init__(self, scheduler: Scheduler, receiver: KVReceiver | None) -> None:
        self.scheduler, self.receiver = scheduler, receiver

    def after_model(self, so: SchedulerOutput, out: ModelRunnerOutput, model_seconds: float) -> list[EndedEarly]:
        self.scheduler.update_kv_transfer(out.kv_connector_output if out is not None else None)
        failed = self.scheduler.take_load_failed()
        for group in failed:
            logger.warning("request %s: %s", group.request_id, self.LOAD_FAILED)
        return [(group, self.LOAD_FAILED) for group in failed]

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver = None
