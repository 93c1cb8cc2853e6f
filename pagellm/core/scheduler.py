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
   A request whose next uncached block is one a running prefill is about to compute waits until
   it is cached (SGLang's in-batch prefix caching): requests that arrive together with a common
   prefix compute it once instead of once each in the same step.

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

import itertools
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
        self._seq_ids = itertools.count()
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
            self.kv_cache_manager.free(seq)  # a no-op for sequences that finished earlier
            if seq.seq_id not in self._finished_seq_ids:
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
            if group.beam_state is not None:
                group.beam_state.pending.clear()  # recomputed beams sample again
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

    def _num_running_seqs(self) -> int:
        return sum(g.num_seqs_reserved for g in self.running)

    def _fits_now(self, group: SequenceGroup) -> bool:
        """Whether the best waiting request could be admitted this step as things stand."""
        if self._num_running_seqs() + group.num_seqs_reserved > self.config.max_num_seqs:
            return False
        plan = self._plan_admission(group, self.config.max_num_batched_tokens)
        need = self.kv_cache_manager.num_new_blocks_for_admission(plan)
        self._unplan(group)
        return need + self.kv_cache_manager.watermark_blocks <= self.kv_cache_manager.num_free_blocks

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
    def _plan(self, group: SequenceGroup, token_budget: int) -> list[tuple[Sequence, int]]:
        """``(seq, new tokens)`` for the group's live sequences, in order, within the budget."""
        plan = []
        for seq in group.live_seqs():
            if token_budget <= 0:
                break
            n = self._num_new_tokens(seq, token_budget)
            if n > 0:  # 0: a beam that sampled and waits for its siblings
                plan.append((seq, n))
                token_budget -= n
        return plan

    def _plan_admission(self, group: SequenceGroup, token_budget: int) -> list[tuple[Sequence, int, list]]:
        """Like ``_plan`` for a waiting group, with each sequence's prefix-cache hit counted as computed.
        Sets ``num_computed_tokens`` from the hits; ``_unplan`` undoes that."""
        kv = self.kv_cache_manager
        plan = []
        for seq in group.live_seqs():
            if token_budget <= 0:
                break
            hits = kv.get_computed_blocks(seq, group.cache_salt)
            seq.num_computed_tokens = len(hits) * kv.block_size
            n = self._num_new_tokens(seq, token_budget)
            plan.append((seq, n, hits))
            token_budget -= n
        return plan

    def _pending_block_hashes(self, groups: Iterable[SequenceGroup]) -> set[bytes]:
        """Hashes of the full blocks that these (running) groups have yet to compute and cache."""
        bs = self.kv_cache_manager.block_size
        return {h for group in groups for seq in group.live_seqs()
                for h in seq.block_hashes[seq.num_computed_tokens // bs:]}

    @staticmethod
    def _unplan(group: SequenceGroup) -> None:
        for seq in group.live_seqs():
            seq.num_computed_tokens = 0

    def _allocate(self, plan: list[tuple[Sequence, int]]) -> bool:
        """All of the plan's blocks, or nothing."""
        kv = self.kv_cache_manager
        if sum(kv.num_new_blocks(seq, n) for seq, n in plan) > kv.num_free_blocks:
            return False
        for seq, n in plan:
            assert kv.allocate_slots(seq, n) is not None
        return True

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        kv = self.kv_cache_manager
        token_budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[SequenceGroup, list[tuple[Sequence, int]]]] = []
        ops = CacheOps()
        if self.priority_policy:
            self.running.sort(key=self._key)  # the worst is last: the next victim
            forced = self._preempt_for_priority(ops)
        else:
            forced = []
        preempted: list[SequenceGroup] = []

        # 1. Running requests first, best first; preempt the worst when blocks run out. A
        #    request's sequences are scheduled (and preempted) together.
        i = 0
        while i < len(self.running) and token_budget > 0:
            group = self.running[i]
            plan = self._plan(group, token_budget)
            while not self._allocate(plan):
                victim = self.running.pop()
                if victim is group and not self.running:
                    # Alone with the whole pool and still out of blocks (forks outgrew it): it
                    # can never go on. End it with what it has instead of recomputing forever.
                    self._ignore(group)
                    break
                self._preempt(victim, ops)
                preempted.append(victim)
                if victim is group:
                    break
            else:
                scheduled.append((group, plan))
                token_budget -= sum(n for _, n in plan)
                i += 1
                continue
            break  # ``group`` preempted itself: nobody after it is left

        # 2. Swapped requests come back, best first, unless this step had to preempt.
        if not preempted and self.swapped:
            self.swapped.sort(key=self._key)
            while self.swapped and token_budget > 0:
                group = self.swapped[0]
                if self.waiting and self._key(self.waiting.peek()) < self._key(group):
                    break  # a better request waits (e.g. the one this step's priority preemption was for)
                if self._num_running_seqs() + group.num_seqs_reserved > self.config.max_num_seqs:
                    break
                seqs = group.live_seqs()
                n = self._num_new_tokens(seqs[0], max(1, token_budget // len(seqs)))
                status = kv.can_swap_in(seqs, n, running=bool(self.running))
                if status == AllocStatus.NEVER:
                    self._ignore(group)
                    continue
                if status == AllocStatus.LATER:
                    break
                self.swapped.pop(0)
                ops.swap_in.extend(kv.swap_in(seqs))
                self.num_swap_ins += 1
                for seq in seqs:
                    seq.status = SequenceStatus.RUNNING
                self._dequeue_time(group)
                self.running.append(group)
                plan = self._plan(group, min(token_budget, n * len(seqs)))
                assert self._allocate(plan), "can_swap_in promised room for the next tokens"
                scheduled.append((group, plan))
                token_budget -= sum(n for _, n in plan)

        # 3. Waiting requests, best first, unless this step preempted or better work is swapped
        #    out. A cached prefix counts as computed: only the rest is scheduled.
        pending = self._pending_block_hashes(self.running) if kv.enable_caching and self.waiting else set()
        while not preempted and self.waiting and token_budget > 0:
            group = self.waiting.peek()
            if self.swapped and not self._key(group) < self._key(self.swapped[0]):
                break
            if group in forced:
                break  # pushed out this very step for a better request: not back before the next
            if self._num_running_seqs() + group.num_seqs_reserved > self.config.max_num_seqs:
                break
            if any(kv.num_blocks_for(s.num_tokens) > kv.num_blocks for s in group.live_seqs()):
                self._ignore(group)  # could never be held, however empty the pool
                continue
            adm = self._plan_admission(group, token_budget)
            first, _, hits = adm[0]
            if len(hits) < len(first.block_hashes) and first.block_hashes[len(hits)] in pending:
                self._unplan(group)  # its next block is being computed: a hit in a step or two
                break
            unchunked_ok = self.config.enable_chunked_prefill or all(
                n == seq.num_tokens - seq.num_computed_tokens for seq, n, _ in adm)
            # The watermark only matters when someone is running: an empty engine admits anything that fits.
            reserve = kv.watermark_blocks if self.running else 0
            if not self.running:
                # An empty pool must admit something: the sequences that fit now (a recomputing
                # group may get the rest of its sequences' tokens in later steps).
                while len(adm) > 1 and kv.num_new_blocks_for_admission(adm) > kv.num_free_blocks:
                    adm.pop()[0].num_computed_tokens = 0
            if not unchunked_ok or kv.num_new_blocks_for_admission(adm) + reserve > kv.num_free_blocks:
                self._unplan(group)
                break
            for seq, n, hits in adm:
                assert kv.allocate_slots(seq, n, hits) is not None
                self.prefix_cache_stats.queries += seq.num_tokens
                self.prefix_cache_stats.hits += seq.num_computed_tokens
            for seq in group.live_seqs():
                seq.status = SequenceStatus.RUNNING
            if group.metrics.first_scheduled_time is None:  # first admission, not a resume
                group.metrics.first_scheduled_time = time.monotonic()
                group.num_cached_tokens = adm[0][0].num_computed_tokens
            self.waiting.pop()
            self._dequeue_time(group)
            self.running.append(group)
            plan = [(seq, n) for seq, n, _ in adm]
            pending |= self._pending_block_hashes([group])  # empty with caching off: nothing is hashed
            scheduled.append((group, plan))
            token_budget -= sum(n for _, n in plan)

        ops.copy.extend(kv.take_copies())
        out = SchedulerOutput(
            scheduled=[self._make_scheduled(g, seq, n) for g, plan in scheduled for seq, n in plan],
            num_batched_tokens=self.config.max_num_batched_tokens - token_budget,
            cache_ops=ops,
            finished_seq_ids=self._finished_seq_ids,
            preempted_request_ids=[g.request_id for g in forced + preempted],
        )
        self._finished_seq_ids = []
        return out

    def new_seq_id(self) -> int:
        """A fresh sequence id (the engine's first sequences and every fork draw from one counter)."""
        return next(self._seq_ids)

    def _make_scheduled(self, group: SequenceGroup, seq: Sequence, n: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        do_sample = start + n == seq.num_tokens
        sample_ids = None
        if do_sample and not group.forked and group.num_samples > 1 and group.beam_state is None:
            # The request's first sample: draw one token per future sequence from this row.
            sample_ids = [seq.seq_id] + [self.new_seq_id() for _ in range(group.num_samples - 1)]
        return ScheduledSequence(
            request_id=group.request_id,
            seq_id=seq.seq_id,
            token_ids=seq.token_ids_range(start, start + n),
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(seq.seq_id),
            do_sample=do_sample,
            sampling_params=group.sampling_params,
            output_token_ids=seq.output_token_ids,
            prompt_token_ids=seq.prompt_token_ids,
            sample_seq_ids=sample_ids,
        )

    # ------------------------------------------------------------------ results
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> tuple[list[SequenceGroup], list[SequenceGroup]]:
        """Advance ``num_computed_tokens``, append sampled tokens (forking at a request's first
        sample), apply token-level stops; a finished sequence frees its blocks at once.

        Returns ``(groups that got a new token, groups that finished)``.
        """
        updated: dict[str, SequenceGroup] = {}
        finished: list[SequenceGroup] = []
        kv = self.kv_cache_manager
        for sched in scheduler_output.scheduled:
            group = self.requests.get(sched.request_id)
            if group is None:  # aborted after it was scheduled
                continue
            seq = next((s for s in group.seqs if s.seq_id == sched.seq_id), None)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += sched.num_scheduled_tokens
            kv.cache_full_blocks(seq, group.cache_salt)
            if not sched.do_sample:
                continue
            if group.beam_state is not None:
                self._beam_sampled(group, seq, runner_output.sampled[seq.seq_id].top_logprobs or {})
                updated[group.request_id] = group
                if group.is_finished():
                    self._release(group)
                    finished.append(group)
                continue
            targets = [seq]
            if sched.sample_seq_ids is not None and not group.forked:
                for child_id in sched.sample_seq_ids[1:]:
                    child = seq.fork(child_id)
                    kv.fork(seq, child)
                    group.seqs.append(child)
                    targets.append(child)
                group.forked = True
            for target in targets:
                sampled = runner_output.sampled[target.seq_id]
                target.append_token(sampled.token_id, sampled.logprob, sampled.top_logprobs)
                self._check_stop(target, group)
                if target.status.is_finished:
                    self._free_seq(target)
            updated[group.request_id] = group
            if group.is_finished():
                self._release(group)
                finished.append(group)
        return list(updated.values()), finished

    def _beam_sampled(self, group: SequenceGroup, seq: Sequence, top: dict[int, tuple[float, int]]) -> None:
        """Record a beam's candidates; once every running beam has reported, take the beam step:
        surviving parents extend in place, extra children fork (sharing blocks), the rest are freed."""
        state = group.beam_state
        state.pending[seq.seq_id] = {tok: lp for tok, (lp, _) in top.items()}
        beams = group.live_seqs()
        if any(b.seq_id not in state.pending for b in beams):
            return
        step = state.step([b.output_token_ids for b in beams], [state.pending[b.seq_id] for b in beams])
        state.pending.clear()
        kv = self.kv_cache_manager
        new_beams: list[Sequence] = []
        used: set[int] = set()
        if not step.done:
            # A parent's first continuation extends it in place; each further one is a fork taken
            # before any token is appended (so it starts from the parent's state of this step).
            for parent_idx, _, _ in step.running:
                parent = beams[parent_idx]
                if parent.seq_id in used:
                    child = parent.fork(self.new_seq_id())
                    kv.fork(parent, child)
                    group.seqs.append(child)
                    new_beams.append(child)
                else:
                    used.add(parent.seq_id)
                    new_beams.append(parent)
            for beam, (_, token, cum) in zip(new_beams, step.running, strict=True):
                beam.output_token_ids.append(token)
                beam.cumulative_logprob = cum
        for b in beams:  # beams no continuation chose, or all of them when the search is over
            if b.seq_id not in used:
                b.status = SequenceStatus.FINISHED_STOPPED
                self._free_seq(b)
        # Running order follows the search's ranking (HF breaks ties by beam index).
        rank = {b.seq_id: i for i, b in enumerate(new_beams)}
        group.seqs.sort(key=lambda s: rank.get(s.seq_id, len(rank)))

    def _free_seq(self, seq: Sequence) -> None:
        """A sequence finished while its siblings go on: its blocks go back now."""
        self.kv_cache_manager.free(seq)
        self._finished_seq_ids.append(seq.seq_id)

    def finish_seq(self, group: SequenceGroup, seq: Sequence, status: SequenceStatus) -> None:
        """End one sequence from outside the step (a stop string); the request ends with its last one."""
        if seq.status.is_finished:
            return
        seq.status = status
        if group.is_finished():
            self._release(group)
        else:
            self._free_seq(seq)

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
        assert self._num_running_seqs() <= self.config.max_num_seqs, "more running sequences than max_num_seqs"
        kv = self.kv_cache_manager
        bs = kv.block_size
        live: set[int] = set()
        for g in self.running:
            assert g.queued_since is None, "a running request is still counted as queued"
            for s in g.seqs:
                if s.status.is_finished:
                    assert s.seq_id not in kv.block_tables, f"finished {s.seq_id} still holds blocks"
                    continue
                assert s.status == SequenceStatus.RUNNING, f"{s.seq_id} in running with status {s.status!r}"
                waits = g.beam_state is not None and s.seq_id in g.beam_state.pending  # sampled, waits for siblings
                assert 0 <= s.num_computed_tokens < s.num_tokens or waits, "running sequence has nothing to compute"
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
            for s in g.live_seqs():
                assert s.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED), f"waiting {s.status!r}"
                assert s.num_computed_tokens == 0, "a waiting sequence claims computed tokens"
        kv.check_invariants(live_seq_ids=live, swapped_seq_ids=swapped)
        if not self.requests:
            assert kv.num_free_blocks == kv.num_blocks, "idle but device blocks in use"
            assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks, "idle but CPU blocks in use"
