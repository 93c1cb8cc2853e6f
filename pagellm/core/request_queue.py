"""Queues of requests waiting for admission: FCFS, or by priority (lower value first).

Preempted requests re-enter the waiting queue; under FCFS at the front (they are older than
anything that arrived since), under priority wherever their key puts them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
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
