"""Executable invariants of the scheduler's state: queues disjoint and consistent with statuses,
device blocks owned exactly by running (and loading) sequences, CPU blocks exactly by swapped
ones, both pools whole when idle. Tests call ``Scheduler.check_invariants()`` after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.sequence import SequenceStatus
from pagellm.utils import InvariantError

if TYPE_CHECKING:
    from pagellm.core.scheduler import Scheduler


def check_scheduler_invariants(sched: Scheduler) -> None:
    """Queues disjoint and consistent with statuses; device blocks owned exactly by running
    sequences, CPU blocks exactly by swapped ones; both pools whole when idle."""
    queues = {"running": [g.request_id for g in sched.running], "waiting": [g.request_id for g in sched.waiting],
              "swapped": [g.request_id for g in sched.swapped], "loading": list(sched.loading)}
    for name, ids in queues.items():
        if len(set(ids)) != len(ids):
            raise InvariantError(f"a request is twice in {name}")
    all_ids = [rid for ids in queues.values() for rid in ids]
    if len(set(all_ids)) != len(all_ids):
        raise InvariantError("a request is in two queues")
    if set(all_ids) != set(sched.requests):
        raise InvariantError("request map out of sync with queues")
    if not sched.in_flight <= {g.request_id for g in sched.running}:
        # (preemption never picks a request with a step in flight: see _worst_running)
        raise InvariantError("a request with a step in flight is not running")
    if sched.num_running_seqs() > sched.config.max_num_seqs:
        raise InvariantError("more running sequences than max_num_seqs")
    kv = sched.kv_cache_manager
    bs = kv.block_size
    live: set[int] = set()
    for g in sched.running:
        if g.queued_since is not None:
            raise InvariantError("a running request is still counted as queued")
        for s in g.seqs:
            if s.status.is_finished:
                if s.seq_id in kv.block_tables:
                    raise InvariantError(f"finished {s.seq_id} still holds blocks")
                continue
            if s.status != SequenceStatus.RUNNING:
                raise InvariantError(f"{s.seq_id} in running with status {s.status!r}")
            waits = g.beam_state is not None and s.seq_id in g.beam_state.pending  # sampled, waits for siblings
            if not (0 <= s.num_computed_tokens < s.num_tokens or waits):
                raise InvariantError("running sequence has nothing to compute")
            held = len(kv.block_tables.get(s.seq_id, ())) * bs
            if held < s.num_computed_tokens:
                raise InvariantError("computed tokens without blocks")
            live.add(s.seq_id)
    swapped: set[int] = set()
    for g in sched.swapped:
        if g.queued_since is None:
            raise InvariantError("a swapped request is not counted as queued")
        for s in g.live_seqs():
            if s.status != SequenceStatus.SWAPPED:
                raise InvariantError(f"{s.seq_id} in swapped with status {s.status!r}")
            if len(kv.cpu_block_tables.get(s.seq_id, ())) * bs < s.num_computed_tokens:
                raise InvariantError("swapped K/V lost")
            swapped.add(s.seq_id)
    for g in sched.waiting:
        if g.queued_since is None:
            raise InvariantError("a waiting request is not counted as queued")
        for s in g.live_seqs():
            if s.status not in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
                raise InvariantError(f"waiting {s.status!r}")
            if s.num_computed_tokens != 0:
                raise InvariantError("a waiting sequence claims computed tokens")
    for g in sched.loading.values():
        if len(g.seqs) != 1 or g.seqs[0].status != SequenceStatus.WAITING or g.queued_since is not None:
            raise InvariantError(f"loading request {g.request_id!r} in an impossible state")
        live.add(g.seqs[0].seq_id)
    kv.check_invariants(live_seq_ids=live, swapped_seq_ids=swapped)
    if not sched.requests:
        if kv.num_free_blocks != kv.num_blocks:
            raise InvariantError("idle but device blocks in use")
        if kv.cpu_pool.num_free_blocks != kv.cpu_pool.num_usable_blocks:
            raise InvariantError("idle but CPU blocks in use")
    if sched.encoder is not None:
        sched.encoder.check_invariants({g.request_id: g for g in sched.running})
