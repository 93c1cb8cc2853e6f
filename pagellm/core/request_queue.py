"""Waiting queue of requests (FCFS; preempted requests re-enter at the front)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

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
