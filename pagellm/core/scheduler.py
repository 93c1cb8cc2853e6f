"""The token-budget scheduler (vLLM V1's unified rule) over waiting and running queues.

Each step every running sequence, then each waiting one in FCFS order, is offered
``min(num_tokens - num_computed_tokens, prefill_chunk_cap, token_budget)`` new tokens. A prompt
chunk, a resumed-after-preemption recompute and a decode are the same case. When the pool cannot
supply the blocks for a running sequence, the newest running request is preempted by recompute
(blocks freed, tokens kept, requeued at the front of ``waiting``); a step that preempted admits
no new requests, so an admission never immediately pushes out older work.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request_queue import FCFSRequestQueue
from pagellm.core.scheduler_output import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
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
        self.waiting = FCFSRequestQueue()
        self.running: list[SequenceGroup] = []
        self.requests: dict[str, SequenceGroup] = {}
        # Sequences finished since the last SchedulerOutput; the worker drops their state.
        self._finished_seq_ids: list[int] = []
        self.num_preemptions = 0
        self.prefix_cache_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, group: SequenceGroup) -> None:
        if group.request_id in self.requests:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self.requests[group.request_id] = group
        self.waiting.add(group)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

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
        elif group in self.waiting:
            self.waiting.remove(group)
        for seq in group.seqs:
            self.kv_cache_manager.free(seq)
            self._finished_seq_ids.append(seq.seq_id)
        del self.requests[group.request_id]

    # ------------------------------------------------------------------ one step
    def _num_new_tokens(self, seq: Sequence, token_budget: int) -> int:
        n = seq.num_tokens - seq.num_computed_tokens
        return min(n, self.config.prefill_chunk_cap, token_budget)

    def _preempt(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.kv_cache_manager.free(seq)
            if not seq.status.is_finished:
                seq.reset_for_recompute()
        group.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(group)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        num_scheduled: dict[int, int] = {}
        scheduled_groups: list[SequenceGroup] = []
        preempted: list[SequenceGroup] = []

        # 1. Running requests first, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and token_budget > 0:
            group = self.running[i]
            seq = group.seqs[0]
            n = self._num_new_tokens(seq, token_budget)
            while self.kv_cache_manager.allocate_slots(seq, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
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

        # 2. Waiting requests, FCFS, unless this step had to preempt. A cached prefix counts as
        #    computed: only the rest is scheduled.
        kv = self.kv_cache_manager
        while (not preempted and self.waiting and token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            group = self.waiting.peek()
            seq = group.seqs[0]
            computed = kv.get_computed_blocks(seq, group.cache_salt)
            seq.num_computed_tokens = len(computed) * kv.block_size
            n = self._num_new_tokens(seq, token_budget)
            fits = self.config.enable_chunked_prefill or n == seq.num_tokens - seq.num_computed_tokens
            if not fits or kv.allocate_slots(seq, n, computed) is None:
                seq.num_computed_tokens = 0
                break
            if group.metrics.first_scheduled_time is None:  # first admission, not a resume
                group.metrics.first_scheduled_time = time.monotonic()
                group.num_cached_tokens = seq.num_computed_tokens
            self.prefix_cache_stats.queries += seq.num_tokens
            self.prefix_cache_stats.hits += seq.num_computed_tokens
            self.waiting.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            num_scheduled[seq.seq_id] = n
            scheduled_groups.append(group)
            token_budget -= n

        out = SchedulerOutput(
            scheduled=[self._make_scheduled(g, num_scheduled[g.seqs[0].seq_id]) for g in scheduled_groups],
            num_batched_tokens=self.config.max_num_batched_tokens - token_budget,
            finished_seq_ids=self._finished_seq_ids,
            preempted_request_ids=[g.request_id for g in preempted],
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
        """Queues disjoint and consistent with statuses; blocks owned exactly by running sequences."""
        running_ids = [g.request_id for g in self.running]
        waiting_ids = [g.request_id for g in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is twice in running"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is twice in waiting"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self.requests), "request map out of sync with queues"
        assert len(self.running) <= self.config.max_num_seqs, "more running than max_num_seqs"
        bs = self.kv_cache_manager.block_size
        live: set[int] = set()
        for g in self.running:
            for s in g.seqs:
                assert s.status == SequenceStatus.RUNNING, f"{s.seq_id} in running with status {s.status!r}"
                assert 0 <= s.num_computed_tokens < s.num_tokens, "running sequence has nothing left to compute"
                n_blocks = len(self.kv_cache_manager.block_tables.get(s.seq_id, ()))
                assert n_blocks * bs >= s.num_computed_tokens, "computed tokens without blocks"
                live.add(s.seq_id)
        for g in self.waiting:
            for s in g.seqs:
                assert s.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED), f"waiting {s.status!r}"
                assert s.num_computed_tokens == 0, "a waiting sequence claims computed tokens"
        self.kv_cache_manager.check_invariants(live_seq_ids=live)
        if not self.requests:
            assert self.kv_cache_manager.num_free_blocks == self.kv_cache_manager.num_blocks, "idle but blocks in use"
