"""The token-budget scheduler (vLLM V1's unified rule) over waiting, running and swapped queues.

Each step, in this order:

1. (priority policy) A waiting request that outranks the worst running one (strictly better base
   priority and better effective priority) and cannot be admitted as things stand preempts
   running requests, worst first, until it can.
2. Every running sequence, best first (oldest under FCFS), is offered
   ``min(num_tokens - num_computed_tokens, prefill_chunk_cap, token_budget)`` new tokens. A prompt
   chunk, a resumed recompute and a decode are the same case. When the pool cannot supply the
   blocks, the worst running request (the newest under FCFS) is preempted.
3. Swapped requests, best first, are swapped back in while blocks (above the watermark) allow.
4. Waiting requests, best first, are admitted with their prefix-cache hits counted as computed.
   Nobody is admitted while an older (or, under priority, better) request is still swapped out.

Steps 3 and 4 are skipped in a step whose step 2 preempted anyone: that step had no room, and an
admission must never push out older work at once.

Preemption mode (``SchedulerConfig.preemption_mode``): ``recompute`` frees the blocks and requeues
the request at the front of ``waiting`` (its tokens are kept and recomputed as one prompt);
``swap`` copies its blocks to the CPU swap pool and parks it in ``swapped``; ``auto`` swaps only
requests with several live sequences (parallel samples, beams), whose shared blocks recompute
cannot rebuild cheaply, and recomputes the rest. When the swap pool is full, swap falls back to
recompute instead of failing.

Priority aging: under the priority policy a request's effective priority is
``priority - steps_queued // priority_aging_steps``, where ``steps_queued`` counts the engine
steps it has spent waiting or swapped out. A low-priority request that keeps being preempted
gains a level every ``priority_aging_steps`` queued steps, so it eventually comes before newer
arrivals in the queues and can no longer be preempted by them. Aging alone never preempts: that
takes a strictly better base priority too, so requests cannot evict each other in turns.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import AllocStatus, KVCacheManager
from pagellm.core.request_queue import FCFSRequestQueue, PriorityRequestQueue
from pagellm.core.scheduler_output import CacheOps, ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from pagellm.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class PrefixCacheStats:
    """Token-weighted prefix-cache counters: ``queries`` tokens looked up, ``hits`` found cached."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class Scheduler:
    """Decides, each step, which sequences compute how many tokens; owns all block bookkeeping."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.priority_policy = config.scheduling_policy == "priority"
        self.waiting = PriorityRequestQueue(self._key) if self.priority_policy else FCFSRequestQueue()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.requests: dict[str, SequenceGroup] = {}
        # Sequences finished since the last SchedulerOutput; the worker drops their state.
        self._finished_seq_ids: list[int] = []
        # Requests that can never fit, finished inside schedule(); the engine reports them.
        self._ignored: list[SequenceGroup] = []
        self._step = 0
        self._num_arrivals = 0
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swap_fallbacks = 0  # swap wanted, pool full: recomputed instead
        self.prefix_cache_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ ordering
    def _key(self, group: SequenceGroup) -> tuple[int, ...]:
        """Smaller is served first and preempted last: arrival order, or (effective priority, arrival)."""
        if not self.priority_policy:
            return (group.arrival_index,)
        return (self._effective_priority(group), group.arrival_index)

    def _effective_priority(self, group: SequenceGroup) -> int:
        aging = self.config.priority_aging_steps
        if not aging:
            return group.priority
        queued = group.steps_queued + (self._step - group.queued_since if group.queued_since is not None else 0)
        return group.priority - queued // aging

    def _enqueue_time(self, group: SequenceGroup) -> None:
        group.queued_since = self._step

    def _dequeue_time(self, group: SequenceGroup) -> None:
        if group.queued_since is not None:
            group.steps_queued += self._step - group.queued_since
            group.queued_since = None

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, group: SequenceGroup) -> None:
        if group.request_id in self.requests:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        group.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        self._enqueue_time(group)
        self.requests[group.request_id] = group
        self.waiting.add(group)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

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
            self._release(group)
            done.append(group)
        return done

    def _release(self, group: SequenceGroup) -> None:
        if group in self.running:
            self.running.remove(group)
        elif group in self.swapped:
            self.swapped.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
        for seq in group.seqs:
            self.kv_cache_manager.free(seq)
            self._finished_seq_ids.append(seq.seq_id)
        del self.requests[group.request_id]

    # ------------------------------------------------------------------ preemption
    def _num_new_tokens(self, seq: Sequence, token_budget: int) -> int:
        n = seq.num_tokens - seq.num_computed_tokens
        return min(n, self.config.prefill_chunk_cap, token_budget)

    def _preempt(self, group: SequenceGroup, ops: CacheOps) -> None:
        """Swap ``group`` out or drop its K/V for recompute, per the preemption mode (see module doc)."""
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
            for seq in group.seqs:
                kv.free(seq)
                if not seq.status.is_finished:
                    seq.reset_for_recompute()
            self.waiting.prepend(group)
        group.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_time(group)

    def _ignore(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_IGNORED
        self._release(group)
        self._ignored.append(group)

    def _fits_now(self, group: SequenceGroup) -> bool:
        """Whether the best waiting request could be admitted this step as things stand."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        kv = self.kv_cache_manager
        seq = group.seqs[0]
        computed = kv.get_computed_blocks(seq, group.cache_salt)
        n = min(seq.num_tokens - len(computed) * kv.block_size, self.config.prefill_chunk_cap,
                self.config.max_num_batched_tokens)
        return kv.can_allocate(seq, len(computed) * kv.block_size + n, computed, kv.watermark_blocks)

    def _outranks(self, group: SequenceGroup, victim: SequenceGroup) -> bool:
        """May ``group`` push ``victim`` out? Only with a strictly better base priority *and* a
        better effective one: aging orders the queues and shields an aged victim, but never starts
        a preemption itself (two equal requests aging past each other would evict each other forever)."""
        return group.priority < victim.priority and self._key(group) < self._key(victim)

    def _preempt_for_priority(self, ops: CacheOps) -> list[SequenceGroup]:
        """Push out running requests the best waiting one outranks, worst first, until it fits."""
        forced: list[SequenceGroup] = []
        if not self.waiting:
            return forced
        best = self.waiting.peek()
        while self.running and self._outranks(best, self.running[-1]) and not self._fits_now(best):
            victim = self.running.pop()
            self._preempt(victim, ops)
            forced.append(victim)
        return forced

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        self._step += 1
        kv = self.kv_cache_manager
        token_budget = self.config.max_num_batched_tokens
        num_scheduled: dict[int, int] = {}
        scheduled_groups: list[SequenceGroup] = []
        ops = CacheOps()
        if self.priority_policy:
            self.running.sort(key=self._key)  # the worst is last: the next victim
            forced = self._preempt_for_priority(ops)
        else:
            forced = []
        preempted: list[SequenceGroup] = []

        # 1. Running requests first, best first; preempt the worst when blocks run out.
        i = 0
        while i < len(self.running) and token_budget > 0:
            group = self.running[i]
            seq = group.seqs[0]
            n = self._num_new_tokens(seq, token_budget)
            while kv.allocate_slots(seq, n) is None:
                victim = self.running.pop()
                self._preempt(victim, ops)
                preempted.append(victim)
                if victim is group:
                    break
            else:
                num_scheduled[seq.seq_id] = n
                scheduled_groups.append(group)
                token_budget -= n
                i += 1
                continue
            break  # ``group`` preempted itself: nobody after it is left

        # 2. Swapped requests come back, best first, unless this step had to preempt.
        if not preempted and self.swapped:
            self.swapped.sort(key=self._key)
            while self.swapped and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
                group = self.swapped[0]
                if self.waiting and self._key(self.waiting.peek()) < self._key(group):
                    break  # a better request waits (e.g. the one this step's priority preemption was for)
                seq = group.seqs[0]
                n = self._num_new_tokens(seq, token_budget)
                status = kv.can_swap_in(group.live_seqs(), n, running=bool(self.running))
                if status == AllocStatus.NEVER:
                    self._ignore(group)
                    continue
                if status == AllocStatus.LATER:
                    break
                self.swapped.pop(0)
                ops.swap_in.extend(kv.swap_in(group.live_seqs()))
                self.num_swap_ins += 1
                allocated = kv.allocate_slots(seq, n)
                assert allocated is not None, "can_swap_in promised room for the new tokens"
                seq.status = SequenceStatus.RUNNING
                self._dequeue_time(group)
                self.running.append(group)
                num_scheduled[seq.seq_id] = n
                scheduled_groups.append(group)
                token_budget -= n

        # 3. Waiting requests, best first, unless this step preempted or better work is swapped
        #    out. A cached prefix counts as computed: only the rest is scheduled.
        while (not preempted and self.waiting and token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            group = self.waiting.peek()
            if self.swapped and not self._key(group) < self._key(self.swapped[0]):
                break
            if group in forced:
                break  # pushed out this very step for a better request: not back before the next
            seq = group.seqs[0]
            if kv.num_blocks_for(seq.num_tokens) > kv.num_blocks:
                self._ignore(group)  # could never be held, however empty the pool
                continue
            computed = kv.get_computed_blocks(seq, group.cache_salt)
            seq.num_computed_tokens = len(computed) * kv.block_size
            n = self._num_new_tokens(seq, token_budget)
            fits = self.config.enable_chunked_prefill or n == seq.num_tokens - seq.num_computed_tokens
            # The watermark only matters when someone is running: an empty engine admits anything that fits.
            reserve = kv.watermark_blocks if self.running else 0
            if not fits or kv.allocate_slots(seq, n, computed, reserve) is None:
                seq.num_computed_tokens = 0
                break
            if group.metrics.first_scheduled_time is None:  # first admission, not a resume
                group.metrics.first_scheduled_time = time.monotonic()
                group.num_cached_tokens = seq.num_computed_tokens
            self.prefix_cache_stats.queries += seq.num_tokens
            self.prefix_cache_stats.hits += seq.num_computed_tokens
            self.waiting.pop()
            self._dequeue_time(group)
            seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            num_scheduled[seq.seq_id] = n
            scheduled_groups.append(group)
            token_budget -= n

        out = SchedulerOutput(
            scheduled=[self._make_scheduled(g, num_scheduled[g.seqs[0].seq_id]) for g in scheduled_groups],
            num_batched_tokens=self.config.max_num_batched_tokens - token_budget,
            cache_ops=ops,
            finished_seq_ids=self._finished_seq_ids,
            preempted_request_ids=[g.request_id for g in forced + preempted],
        )
        self._finished_seq_ids = []
        return out

    def _make_scheduled(self, group: SequenceGroup, n: int) -> ScheduledSequence:
        seq = group.seqs[0]
        start = seq.num_computed_tokens
        return ScheduledSequence(
            request_id=group.request_id,
            seq_id=seq.seq_id,
            token_ids=seq.token_ids_range(start, start + n),
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(seq.seq_id),
            do_sample=start + n == seq.num_tokens,
            sampling_params=group.sampling_params,
            output_token_ids=seq.output_token_ids,
            prompt_token_ids=seq.prompt_token_ids,
        )

    # ------------------------------------------------------------------ results
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> tuple[list[SequenceGroup], list[SequenceGroup]]:
        """Advance ``num_computed_tokens``, append sampled tokens, apply token-level stops.

        Returns ``(groups that got a new token, groups that finished)``; finished ones are freed.
        """
        updated: list[SequenceGroup] = []
        finished: list[SequenceGroup] = []
        for sched in scheduler_output.scheduled:
            group = self.requests.get(sched.request_id)
            if group is None:  # aborted after it was scheduled
                continue
            seq = group.seqs[0]
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += sched.num_scheduled_tokens
            self.kv_cache_manager.cache_full_blocks(seq, group.cache_salt)
            if not sched.do_sample:
                continue
            sampled = runner_output.sampled[seq.seq_id]
            seq.append_token(sampled.token_id, sampled.logprob, sampled.top_logprobs)
            self._check_stop(seq, group)
            updated.append(group)
            if group.is_finished():
                self._release(group)
                finished.append(group)
        return updated, finished

    def _check_stop(self, seq: Sequence, group: SequenceGroup) -> None:
        params = group.sampling_params
        token = seq.output_token_ids[-1]
        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token == params.eos_token_id:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token
                return
        if (params.max_tokens is not None and n_out >= params.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Queues disjoint and consistent with statuses; device blocks owned exactly by running
        sequences, CPU blocks exactly by swapped ones; both pools whole when idle."""
        queues = {"running": [g.request_id for g in self.running], "waiting": [g.request_id for g in self.waiting],
                  "swapped": [g.request_id for g in self.swapped]}
        for name, ids in queues.items():
            assert len(set(ids)) == len(ids), f"a request is twice in {name}"
        all_ids = [rid for ids in queues.values() for rid in ids]
        assert len(set(all_ids)) == len(all_ids), "a request is in two queues"
        assert set(all_ids) == set(self.requests), "request map out of sync with queues"
        assert len(self.running) <= self.config.max_num_seqs, "more running than max_num_seqs"
        kv = self.kv_cache_manager
        bs = kv.block_size
        live: set[int] = set()
        for g in self.running:
            assert g.queued_since is None, "a running request is still counted as queued"
            for s in g.seqs:
                assert s.status == SequenceStatus.RUNNING, f"{s.seq_id} in running with status {s.status!r}"
                assert 0 <= s.num_computed_tokens < s.num_tokens, "running sequence has nothing left to compute"
                held = len(kv.block_tables.get(s.seq_id, ())) * bs
                assert held >= s.num_computed_tokens, "computed tokens without blocks"
                live.add(s.seq_id)
        swapped: set[int] = set()
        for g in self.swapped:
            assert g.queued_since is not None, "a swapped request is not counted as queued"
            for s in g.live_seqs():
                assert s.status == SequenceStatus.SWAPPED, f"{s.seq_id} in swapped with status {s.status!r}"
                assert len(kv.cpu_block_tables.get(s.seq_id, ())) * bs >= s.num_computed_tokens, "swapped K/V lost"
                swapped.add(s.seq_id)
        for g in self.waiting:
            assert g.queued_since is not None, "a waiting request is not counted as queued"
            for s in g.seqs:
                assert s.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED), f"waiting {s.status!r}"
                assert s.num_computed_tokens == 0, "a waiting sequence claims computed tokens"
        kv.check_invariants(live_seq_ids=live, swapped_seq_ids=swapped)
        if not self.requests:
            assert kv.num_free_blocks == kv.num_blocks, "idle but device blocks in use"
            assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks, "idle but CPU blocks in use"
