"""The token-budget scheduler (vLLM V1's unified rule) over waiting, running and swapped queues.

Each step, in this order (``RequestOrder`` says what "best" and "worst" are):

1. (priority policy) A waiting request that outranks the worst running one and cannot be admitted
   as things stand preempts running requests, worst first, until it can.
2. Every running sequence, best first, is offered ``min(num_tokens - num_computed_tokens,
   prefill_chunk_cap, token_budget)`` new tokens (``StepPlanner``): a prompt chunk, a resumed
   recompute and a decode are the same case. When the pool cannot supply the blocks, the worst
   running request is preempted (``_preempt``: by swap or recompute).
3. Swapped requests, best first, are swapped back in while blocks (above the watermark) allow.
4. Waiting requests, best first, are admitted with their prefix-cache hits counted as computed.
   Nobody is admitted past an older (better) swapped request. A request whose next uncached
   block is one a running prefill is about to compute waits until it is cached (SGLang's
   in-batch prefix caching), so requests with a common prefix compute it once. A request whose
   prefix a KV connector holds loads it first (``KVTransferAdmission``).

Steps 3 and 4 are skipped in a step whose step 2 preempted anyone: that step had no room, and an
admission must never push out older work at once.

Batch queue (``max_concurrent_batches`` > 1): the engine schedules a step while earlier ones
compute. A request with a step in flight (``in_flight``; preemption never picks it) is skipped
until that step's output is applied, so no token is computed on a guess; each step takes at most
``1 / max_concurrent_batches`` of the running requests (vLLM V0's virtual engines).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

from pagellm.config import SchedulerConfig
from pagellm.core.encoder_cache_manager import EncoderCacheManager
from pagellm.core.invariants import check_scheduler_invariants
from pagellm.core.kv_cache_manager import AllocStatus, KVCacheManager, SlotRequest
from pagellm.core.kv_connector import KVConnectorScheduler
from pagellm.core.kv_transfer_admission import KVTransferAdmission
from pagellm.core.lora_admission import LoRAAdmission
from pagellm.core.multi_step import plan_num_steps
from pagellm.core.output_appliers import apply_beams, apply_computed, apply_pooled, apply_samples
from pagellm.core.request_queue import RequestOrder, create_request_queue, scheduling_policy
from pagellm.core.scheduler_output import (
    CacheOps,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagellm.core.step_decisions import LeftOut, StepDecisions
from pagellm.core.step_planner import StepInProgress, StepPlanner
from pagellm.metrics import PrefixCacheStats, SchedulerStats
from pagellm.sequence import Sequence, SequenceGroup, SequenceStatus


class Scheduler:
    """Decides, each step, which sequences compute how many tokens; owns all block bookkeeping."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, *, max_model_len: int,
                 num_lookahead_tokens: int = 0, max_loras: int = 0,
                 kv_transfer: KVTransferAdmission | None = None, encoder: EncoderCacheManager | None = None) -> None:
        self.config = config
        self.kv_transfer = kv_transfer  # KV transfer's loads and saves (None: no connector)
        # Batch queue: requests in a step whose output is not applied yet.
        self.in_flight: set[str] = set()
        self._load_failed: list[SequenceGroup] = []
        self.num_waiting_for_remote = 0  # in the last schedule(): requests waiting for pushed K/V
        self.lora = LoRAAdmission(max_loras)  # at most max_loras adapters in a step (0: no LoRA)
        # A draft model writes its drafts' K/V past a sampling sequence's scheduled tokens: it
        # gets these slots too when the pool has them (given back after the step).
        self.num_lookahead_tokens = num_lookahead_tokens
        # The step trace: when on, each schedule() leaves its decisions in ``last_decisions``.
        self.record_decisions = False
        self.last_decisions: StepDecisions | None = None
        self._decisions: StepDecisions | None = None
        self.kv_cache_manager = kv_cache_manager
        # A vision-language model's encoder cache and budget (None: text only).
        self.encoder = encoder
        self.planner = StepPlanner(config, kv_cache_manager, max_model_len, encoder)
        self.max_model_len = max_model_len
        self.priority_policy = scheduling_policy(config.scheduling_policy).by_priority
        self.order = RequestOrder(self.priority_policy, config.priority_aging_steps)
        self.waiting = create_request_queue(config.scheduling_policy, self.order)
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.requests: dict[str, SequenceGroup] = {}
        # Sequences finished since the last SchedulerOutput; the worker drops their state.
        self._finished_seq_ids: list[int] = []
        # Requests that can never fit, finished inside schedule(); the engine reports them.
        self._ignored: list[SequenceGroup] = []
        self._num_arrivals = 0
        self._seq_ids = itertools.count()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swap_fallbacks = 0  # swap wanted, pool full: recomputed instead
        self.prefix_cache_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, group: SequenceGroup) -> None:
        if group.request_id in self.requests:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        group.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        self.order.enqueue(group)
        self.requests[group.request_id] = group
        self.waiting.add(group)

    def take_load_failed(self) -> list[SequenceGroup]:
        """Requests ended (aborted) because their K/V load failed under the ``fail`` policy."""
        out, self._load_failed = self._load_failed, []
        return out

    @property
    def connector(self) -> KVConnectorScheduler | None:
        return self.kv_transfer.connector if self.kv_transfer is not None else None

    @property
    def loading(self) -> dict[str, SequenceGroup]:
        """Requests whose prefix the connector's worker side loads this step."""
        return self.kv_transfer.loading if self.kv_transfer is not None else {}

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def make_stats(self) -> SchedulerStats:
        """The queues, the pools' use and the counters, now."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            kv_cache_usage=kv.usage(), cpu_cache_usage=kv.cpu_pool.usage(),
            num_preemptions=self.num_preemptions, num_swap_outs=self.num_swap_outs, num_swap_ins=self.num_swap_ins,
            num_swap_fallbacks=self.num_swap_fallbacks, prefix_cache_queries=self.prefix_cache_stats.queries,
            prefix_cache_hits=self.prefix_cache_stats.hits,
            **(self.kv_transfer.stats() if self.kv_transfer is not None else {}),
            **(self.encoder.stats() if self.encoder is not None else {}))

    def take_ignored(self) -> list[SequenceGroup]:
        """Requests finished as ``FINISHED_IGNORED`` by the last ``schedule()`` (they never fit)."""
        out, self._ignored = self._ignored, []
        return out

    def finish_requests(self, request_ids: str | Iterable[str], status: SequenceStatus) -> list[SequenceGroup]:
        """End requests from outside the step (abort, stop string): free their blocks at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        done = []
        for rid in request_ids:
            group = self.requests.get(rid)
            if group is None:
                continue
            for seq in group.seqs:
                if not seq.status.is_finished:
                    seq.status = status
            self.release(group)
            done.append(group)
        return done

    def release(self, group: SequenceGroup) -> None:
        if group in self.running:
            self.running.remove(group)
        elif group in self.swapped:
            self.swapped.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
        else:
            self.loading.pop(group.request_id, None)  # (its load, in flight, ends before any reuse)
        self.in_flight.discard(group.request_id)  # (an in-flight step's writes end before any reuse)
        for seq in group.seqs:
            self.kv_cache_manager.free(seq)  # a no-op for sequences that finished earlier
            if seq.seq_id not in self._finished_seq_ids:
                self._finished_seq_ids.append(seq.seq_id)
        del self.requests[group.request_id]
        self.lora.forget(group.request_id)
        if self.encoder is not None:
            self.encoder.release(group)

    # ------------------------------------------------------------------ preemption
    def _preempt(self, group: SequenceGroup, ops: CacheOps) -> None:
        """Swap ``group`` out or drop its K/V for recompute, per ``preemption_mode``: ``recompute``
        frees the blocks and requeues it at the front of ``waiting`` (its tokens are kept and
        recomputed as one prompt); ``swap`` copies its blocks to the CPU pool and parks it in
        ``swapped``; ``auto`` swaps only requests with several live sequences (samples, beams),
        whose shared blocks recompute cannot rebuild cheaply. A full swap pool means recompute."""
        kv = self.kv_cache_manager
        seqs = group.live_seqs()
        mode = self.config.preemption_mode
        want_swap = mode == "swap" or (mode == "auto" and len(seqs) > 1)
        if want_swap and kv.can_swap_out(seqs) == AllocStatus.OK:
            ops.swap_out.extend(kv.swap_out(seqs))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            group.metrics.num_swaps += 1
            self.num_swap_outs += 1
            self.swapped.append(group)
        else:
            self.num_swap_fallbacks += want_swap
            if group.beam_state is not None:
                group.beam_state.pending.clear()  # recomputed beams sample again
            for seq in group.seqs:
                kv.free(seq)
                if not seq.status.is_finished:
                    seq.reset_for_recompute()
            self.waiting.prepend(group)
        if self.encoder is not None:
            self.encoder.release(group)  # (its entries stay cached while nobody needs the room)
        group.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.order.enqueue(group)
        if self._decisions is not None:
            self._decisions.preempted.append((group.request_id, "swap" if group in self.swapped else "recompute"))

    def _ignore(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_IGNORED
        self.release(group)
        self._ignored.append(group)

    def num_running_seqs(self) -> int:
        return sum(g.num_seqs_reserved for g in self.running)

    def _has_seq_room(self, group: SequenceGroup) -> bool:
        return self.num_running_seqs() + group.num_seqs_reserved <= self.config.max_num_seqs

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """One step: priority preemption, running, swapped, waiting (see the module docstring)."""
        self.order.step += 1
        self.num_waiting_for_remote = 0
        step = StepInProgress(token_budget=self.config.max_num_batched_tokens, encoder=self.encoder)
        if self.encoder is not None:
            self.encoder.begin_step()
        self._decisions = StepDecisions(token_budget=step.token_budget) if self.record_decisions else None
        if self.kv_cache_manager.has_windows:  # what windows left goes back before anyone is weighed
            for group in self.running:  # (not under a step in flight: it may still read them)
                for seq in group.live_seqs() if group.request_id not in self.in_flight else ():
                    self.kv_cache_manager.remove_skipped_blocks(seq)
        if self.priority_policy:
            self.running.sort(key=self.order.key)  # the worst is last: the next victim
            self._preempt_for_priority(step)
        self._schedule_running(step)
        if not step.preempted:  # a step that had to preempt has no room to take anyone back
            self._schedule_swapped(step)
            self._schedule_waiting(step)
        else:
            step.waiting_stop = LeftOut.NO_ROOM_AFTER_PREEMPTION
        if self._decisions is not None:
            self._record_left_out(step, self._decisions)
        self.last_decisions = self._decisions
        return self._make_output(step)

    def _record_left_out(self, step: StepInProgress, d: StepDecisions) -> None:
        d.token_budget_used = d.token_budget - step.token_budget
        for i, group in enumerate(self.waiting):
            d.left_out[group.request_id] = LeftOut.PRIORITY if self.priority_policy and i else step.waiting_stop
        for rid in step.lora_skipped:
            d.left_out[rid] = LeftOut.MAX_LORAS

    def _preempt_for_priority(self, step: StepInProgress) -> None:
        """Phase 0: push out running requests the best waiting one outranks, worst first, until it fits."""
        if not self.waiting:
            return
        best = self.waiting.peek()
        while (worst := self._worst_running()) is not None and self.order.outranks(best, worst) \
                and not self._fits_now(best):
            self.running.remove(worst)
            self._preempt(worst, step.ops)
            step.forced.append(worst)

    def _worst_running(self) -> SequenceGroup | None:
        """The next preemption victim: the worst running request without a step in flight (one
        with a step in flight would lose that step's samples, and with them its seeded draws)."""
        for group in reversed(self.running):
            if group.request_id not in self.in_flight:
                return group
        return None

    def _fits_now(self, group: SequenceGroup) -> bool:
        """Whether the best waiting request could be admitted this step as things stand."""
        if not self._has_seq_room(group):
            return False
        kv = self.kv_cache_manager
        plan = self.planner.plan_admission(group, self.config.max_num_batched_tokens)
        return kv.num_new_blocks(plan) + kv.watermark_blocks <= kv.num_free_blocks

    def _schedule_running(self, step: StepInProgress) -> None:
        """Phase 1: running requests, best first, all of a request's sequences together; when the
        pool runs out of blocks the worst running request is preempted (possibly the one at hand)."""
        depth = self.config.max_concurrent_batches
        limit = -(-len(self.running) // depth)  # a micro-batch: this step's share of the running requests
        taken = 0
        i = 0
        while i < len(self.running) and step.token_budget > 0:
            group = self.running[i]
            if group.request_id in self.in_flight or taken >= limit:
                i += 1
                continue
            plan = self.planner.plan(group, step.token_budget)
            while not self.planner.allocate(plan):
                victim = self._worst_running()
                assert victim is not None  # ``group`` itself at worst
                self.running.remove(victim)
                if victim is group and not self.running:
                    # Alone with the whole pool and still out of blocks (forks outgrew it): it
                    # can never go on. End it with what it has instead of recomputing forever.
                    self._ignore(group)
                    return
                self._preempt(victim, step.ops)
                step.preempted.append(victim)
                if victim is group:
                    return  # ``group`` preempted itself: nobody after it is left
            step.add(group, plan)
            taken += 1
            i += 1

    def _schedule_swapped(self, step: StepInProgress) -> None:
        """Phase 2: swapped requests come back, best first, while blocks above the watermark allow."""
        kv = self.kv_cache_manager
        self.swapped.sort(key=self.order.key)
        while self.swapped and step.token_budget > 0:
            group = self.swapped[0]
            if self.waiting and self.order.key(self.waiting.peek()) < self.order.key(group):
                break  # a better request waits (e.g. the one this step's priority preemption was for)
            if not self._has_seq_room(group):
                break
            if self.lora.over_limit(group, self.lora.adapters(self.running)):
                break  # its adapter would be one too many (it is the oldest swapped work: it goes next)
            seqs = group.live_seqs()
            n = self.planner.num_new_tokens(seqs[0].num_tokens, seqs[0].num_computed_tokens,
                                     max(1, step.token_budget // len(seqs)))
            status = kv.can_swap_in(seqs, n, running=bool(self.running))
            if status == AllocStatus.NEVER:
                self._ignore(group)
                continue
            if status == AllocStatus.LATER:
                break
            self.swapped.pop(0)
            step.ops.swap_in.extend(kv.swap_in(seqs))
            self.num_swap_ins += 1
            if self._decisions is not None:
                self._decisions.swapped_in.append(group.request_id)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.order.dequeue(group)
            self.running.append(group)
            plan = self.planner.plan(group, min(step.token_budget, n * len(seqs)))
            if not self.planner.allocate(plan):
                raise RuntimeError(f"can_swap_in promised room for request {group.request_id!r}'s next tokens")
            step.add(group, plan)

    def _schedule_waiting(self, step: StepInProgress) -> None:
        """Phase 3: waiting requests, best first, with their cached prefix counted as computed;
        nobody is admitted past an older (better) swapped request or a request pushed out this step."""
        kv = self.kv_cache_manager
        pending = self.planner.pending_block_hashes(self.running) if kv.enable_caching and self.waiting else set()
        adapters = self.lora.adapters(self.running)
        skipped: list[SequenceGroup] = []
        lora_skipped: list[str] = []
        while self.waiting and step.token_budget > 0:
            group = self.waiting.peek()
            kvt = self.kv_transfer
            if kvt is not None and kvt.waiting_for_remote(group):
                # WAITING_FOR_REMOTE_KVS: another engine is sending its prefix; it keeps its place.
                self.num_waiting_for_remote += 1
                skipped.append(self.waiting.pop())
                continue
            if kvt is not None and kvt.must_fail(group):
                self._fail_load(group)
                continue
            if self.lora.over_limit(group, adapters):
                if self.lora.may_pass_over(group):  # its adapter would be one too many: it keeps its place
                    skipped.append(self.waiting.pop())
                    lora_skipped.append(group.request_id)
                    continue
                step.waiting_stop = LeftOut.MAX_LORAS
                break
            if self.swapped and not self.order.key(group) < self.order.key(self.swapped[0]):
                step.waiting_stop = LeftOut.OLDER_SWAPPED_FIRST
                break
            if group in step.forced:
                step.waiting_stop = LeftOut.PUSHED_OUT_THIS_STEP
                break  # pushed out this very step for a better request: not back before the next
            if not self._has_seq_room(group):
                step.waiting_stop = LeftOut.MAX_NUM_SEQS
                break
            if any(kv.max_blocks_held(s.num_tokens, self.config.max_num_batched_tokens) > kv.num_blocks
                   for s in group.live_seqs()):
                self._ignore(group)  # could never be held, however empty the pool
                continue
            plan = self.planner.plan_admission(group, step.token_budget)
            first = plan[0]
            if first.num_new_tokens == 0:
                step.waiting_stop = LeftOut.ENCODER_BUDGET  # its first image fits neither the budget nor the cache
                break
            n_hit = len(first.computed_blocks)
            if n_hit < len(first.seq.block_hashes) and first.seq.block_hashes[n_hit] in pending:
                step.waiting_stop = LeftOut.PREFIX_BEING_COMPUTED
                break  # its next block is being computed (or loaded): a hit in a step or two
            n_load = kvt.start_load(group, plan, bool(self.running)) if kvt is not None else 0
            if n_load:
                self.waiting.pop()
                self.order.dequeue(group)
                pending.update(first.seq.block_hashes[n_hit:n_hit + n_load])  # its sharers wait for them
                continue
            if not self.planner.admissible(plan, bool(self.running)):
                step.waiting_stop = self.planner.why_not_admissible(plan)
                break
            self._admit(group, plan)
            pending |= self.planner.pending_block_hashes([group])  # empty with caching off: nothing is hashed
            step.add(group, plan)
            if group.lora_id:
                adapters.add(group.lora_id)
        for group in reversed(skipped):  # back in their places
            self.waiting.prepend(group)
        step.lora_skipped = lora_skipped

    def update_kv_transfer(self, output: KVConnectorOutput | None) -> None:
        """After a step: every loading request goes back to the head of ``waiting`` with what
        arrived cached (or, under the ``fail`` policy with blocks missing, ends)."""
        if self.kv_transfer is None:
            return
        for group, failed in reversed(self.kv_transfer.finish_loads(output)):  # prepended: original order
            self.waiting.prepend(group)
            self.order.enqueue(group)
            if failed:
                self._fail_load(group)

    def _fail_load(self, group: SequenceGroup) -> None:
        """End a request whose K/V did not arrive (policy ``fail``); the engine reports it."""
        for s in group.seqs:
            s.status = SequenceStatus.FINISHED_ABORTED
        self.release(group)
        self._load_failed.append(group)

    def _admit(self, group: SequenceGroup, plan: list[SlotRequest]) -> None:
        """Apply an admission plan: hits become computed tokens, blocks are allocated, the group runs."""
        kv = self.kv_cache_manager
        for r in plan:
            r.seq.num_computed_tokens = r.num_computed_tokens
            if kv.allocate_slots(r.seq, r.num_new_tokens, r.computed_blocks) is None:
                raise RuntimeError(f"allocate_slots failed admitting request {group.request_id!r} after "
                                   "num_new_blocks said the pool had room")
            self.prefix_cache_stats.queries += r.seq.num_tokens
            self.prefix_cache_stats.hits += r.num_computed_tokens
        for seq in group.live_seqs():
            seq.status = SequenceStatus.RUNNING
        if group.metrics.first_scheduled_time is None:  # first admission, not a resume
            group.metrics.first_scheduled_time = time.monotonic()
            group.num_cached_tokens = plan[0].num_computed_tokens
        self.waiting.pop()
        self.order.dequeue(group)
        self.running.append(group)
        if self._decisions is not None:
            self._decisions.admitted.append((group.request_id, plan[0].num_computed_tokens))

    def _make_output(self, step: StepInProgress) -> SchedulerOutput:
        if self.num_lookahead_tokens:
            self.planner.allocate_lookahead(step.scheduled, self.num_lookahead_tokens)
        num_steps = plan_num_steps(step.scheduled, self.config.num_scheduler_steps, bool(self.waiting),
                                   self.kv_cache_manager, self.max_model_len)
        step.ops.copy.extend(self.kv_cache_manager.take_copies())
        out = SchedulerOutput(
            scheduled=[self.planner.make_scheduled(g, r.seq, r.num_new_tokens, self.new_seq_id)
                       for g, plan in step.scheduled for r in plan],
            cache_ops=step.ops,
            finished_seq_ids=self._finished_seq_ids,
            encoder_inputs=self.encoder.to_encode if self.encoder is not None else [],
            freed_encoder_hashes=self.encoder.take_freed() if self.encoder is not None else [],
            preempted_request_ids=[g.request_id for g in step.forced + step.preempted],
            num_steps=num_steps,
        )
        if self.kv_transfer is not None:
            out.kv_connector_metadata = self.kv_transfer.offer_saves(step.scheduled)
        if self.config.max_concurrent_batches > 1:
            self.in_flight.update(g.request_id for g, _ in step.scheduled)
        self._finished_seq_ids = []
        return out

    def new_seq_id(self) -> int:
        """A fresh sequence id (the engine's first sequences and every fork draw from one counter)."""
        return next(self._seq_ids)

    # ------------------------------------------------------------------ results
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> tuple[list[SequenceGroup], list[SequenceGroup]]:
        """Apply a step's results to each sequence it scheduled (``core/output_appliers.py``):
        computed tokens, then a pooled result, beams or samples with their token-level stops; a
        finished sequence frees its blocks at once. Stop strings are the output processor's, which
        ends a sequence through ``finish_seq`` (cutting an accepted run where one ends).

        Returns ``(groups that got a new token, groups that finished)``.
        """
        updated: dict[str, SequenceGroup] = {}
        finished: list[SequenceGroup] = []
        if self.in_flight:
            self.in_flight.difference_update(s.request_id for s in scheduler_output.scheduled)
        for sched in scheduler_output.scheduled:
            group = self.requests.get(sched.request_id)
            if group is None:  # aborted after it was scheduled
                continue
            seq = next((s for s in group.seqs if s.seq_id == sched.seq_id), None)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            accepted = apply_computed(self, group, seq, sched, runner_output)
            if seq.seq_id in runner_output.pooled:
                apply_pooled(self, group, seq, runner_output)
            elif not sched.do_sample:
                continue
            elif group.beam_state is not None:
                apply_beams(self, group, seq, runner_output)
            else:
                apply_samples(self, group, seq, sched, accepted, runner_output)
            updated[group.request_id] = group
            if group.request_id not in self.requests:  # (the applier released it: finished)
                finished.append(group)
        return list(updated.values()), finished

    def fork(self, group: SequenceGroup, parent: Sequence, child_id: int | None = None) -> Sequence:
        """A new sequence of ``group`` sharing every block of ``parent`` (a sample or a beam)."""
        child = parent.fork(self.new_seq_id() if child_id is None else child_id)
        self.kv_cache_manager.fork(parent, child)
        group.seqs.append(child)
        return child

    def free_seq(self, seq: Sequence) -> None:
        """A sequence finished while its siblings go on: its blocks go back now."""
        self.kv_cache_manager.free(seq)
        self._finished_seq_ids.append(seq.seq_id)

    def finish_seq(self, group: SequenceGroup, seq: Sequence, status: SequenceStatus) -> None:
        """End one sequence from outside the step (a stop string); the request ends with its last one."""
        if seq.status.is_finished:
            return
        seq.status = status
        if group.is_finished():
            self.release(group)
        else:
            self.free_seq(seq)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the queues or blocks are inconsistent (``core/invariants.py``)."""
        check_scheduler_invariants(self)
