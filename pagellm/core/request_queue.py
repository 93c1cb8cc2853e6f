"""Queues of requests waiting for admission, one per scheduling policy: FCFS, or by priority
(lower value first); ``SCHEDULING_POLICIES`` is the registry ``create_request_queue`` reads.

Preempted requests re-enter the waiting queue; under FCFS at the front (they are older than
anything that arrived since), under priority wherever their key puts them.

A new policy is its queue class here and its row in ``SCHEDULING_POLICIES`` (and its name in
``config.scheduler.SchedulingPolicy``, the choices users are offered: a test holds the two equal).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pagellm.sequence import SequenceGroup


class FCFSRequestQueue:
    """First come, first served: a deque, with ``prepend`` for requests coming back from preemption."""

    def __init__(self) -> None:
        self._queue: deque[SequenceGroup] = deque()

    def add(self, group: SequenceGroup) -> None:
        self._queue.append(group)

    def prepend(self, group: SequenceGroup) -> None:
        self._queue.appendleft(group)

    def peek(self) -> SequenceGroup:
        return self._queue[0]

    def pop(self) -> SequenceGroup:
        return self._queue.popleft()

    def remove(self, group: SequenceGroup) -> None:
        self._queue.remove(group)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter(self._queue)


class PriorityRequestQueue(FCFSRequestQueue):
    """Smallest ``key(group)`` first. The key may change while a request waits (priority aging),
    so the minimum is found by a scan when asked for, not kept in a heap; queues here are short
    next to the cost of a model step."""

    def __init__(self, key: Callable[[SequenceGroup], Any]) -> None:
        super().__init__()
        self._key = key

    def prepend(self, group: SequenceGroup) -> None:
        self.add(group)

    def peek(self) -> SequenceGroup:
        return min(self._queue, key=self._key)

    def pop(self) -> SequenceGroup:
        group = self.peek()
        self._queue.remove(group)
        return group


@dataclass(frozen=True, slots=True)
class SchedulingPolicySpec:
    """A policy's waiting queue (built from the order's key) and whether requests' priorities rank
    them: ``RequestOrder`` keys by ``(effective priority, arrival)``, a better-priority arrival may
    preempt a running request, and a request may carry a priority at all."""

    queue: Callable[[Callable[[SequenceGroup], Any]], FCFSRequestQueue]
    by_priority: bool


SCHEDULING_POLICIES: dict[str, SchedulingPolicySpec] = {
    "fcfs": SchedulingPolicySpec(lambda key: FCFSRequestQueue(), by_priority=False),
    "priority": SchedulingPolicySpec(PriorityRequestQueue, by_priority=True),
}


def scheduling_policy(name: str) -> SchedulingPolicySpec:
    """The registry's row for ``name``; ``ValueError`` naming the argument for a policy it lacks."""
    try:
        return SCHEDULING_POLICIES[name]
    except KeyError:
        raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, SCHEDULING_POLICIES))}, "
                         f"got {name!r}") from None


def create_request_queue(policy: str, order: RequestOrder) -> FCFSRequestQueue:
    """The waiting queue of ``policy``, ordered by ``order``'s key where the policy orders at all."""
    return scheduling_policy(policy).queue(order.key)


class RequestOrder:
    """Which request is served first and preempted last: smaller keys first. Arrival order, or
    under the priority policy ``(effective priority, arrival)``.

    Priority aging: a request's effective priority is ``priority - steps_queued //
    priority_aging_steps``, where ``steps_queued`` counts the engine steps it has spent waiting or
    swapped out. A low-priority request that keeps being preempted gains a level every
    ``priority_aging_steps`` queued steps, so it eventually comes before newer arrivals in the
    queues and can no longer be preempted by them. Aging alone never preempts (``outranks``), so
    requests cannot evict each other in turns.
    """

    def __init__(self, priority_policy: bool, priority_aging_steps: int) -> None:
        self.priority_policy = priority_policy
        self.aging_steps = priority_aging_steps
        self.step = 0  # the scheduler's step count, the clock of aging

    def key(self, group: SequenceGroup) -> tuple[int, ...]:
        if not self.priority_policy:
            return (group.arrival_index,)
        return (self.effective_priority(group), group.arrival_index)

    def effective_priority(self, group: SequenceGroup) -> int:
        if not self.aging_steps:
            return group.priority
        queued = group.steps_queued + (self.step - group.queued_since if group.queued_since is not None else 0)
        return group.priority - queued // self.aging_steps

    def enqueue(self, group: SequenceGroup) -> None:
        """``group`` starts a stay in a queue (waiting or swapped): it ages from now."""
        group.queued_since = self.step

    def dequeue(self, group: SequenceGroup) -> None:
        """``group`` leaves its queue to run: the stay's steps count, and aging stops."""
        if group.queued_since is not None:
            group.steps_queued += self.step - group.queued_since
            group.queued_since = None

    def outranks(self, group: SequenceGroup, victim: SequenceGroup) -> bool:
        """May ``group`` push ``victim`` out? Only with a strictly better base priority *and* a
        better effective one: aging orders the queues and shields an aged victim, but never starts
        a preemption itself (two equal requests aging past each other would evict each other forever)."""
        return group.priority < victim.priority and self.key(group) < self.key(victim)
