"""The waiting queue's order, by scheduling policy (pure Python): "fcfs" (arrival order) or "priority" (vLLM's:
the lowest `priority` value first, ties by arrival time). The queue also says where an admitted request joins the
running list, whose tail is what the scheduler preempts first when KV blocks run out."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator

from vlserve.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class FCFSQueue(deque):
    """First come, first served: a deque in arrival order (a preempted request goes back to its head); admitted
    requests join the running list's tail, so the latest admitted is preempted first."""

    @staticmethod
    def add_running(running: list[Request], req: Request) -> None:
        running.append(req)


def priority_key(req: Request) -> tuple[int, float]:
    """(priority, arrival time): lower runs first."""
    return req.priority, req.arrival_time


class PriorityQueue:
    """Waiting requests kept sorted by (priority, arrival time, request id); `appendleft` and `extendleft` (a
    preempted or set-aside request) put a request back in its sorted place too. The running list is kept in
    (priority, arrival time) order, so its tail, the first preempted, is the lowest-priority, latest-arrived request
    (vLLM v1 preempts `max(running, key=(priority, arrival_time))`)."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    @staticmethod
    def _key(req: Request) -> tuple[int, float, str]:
        return req.priority, req.arrival_time, req.request_id

    def append(self, req: Request) -> None:
        bisect.insort(self._items, req, key=self._key)

    appendleft = append

    def extendleft(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.append(req)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))

    @staticmethod
    def add_running(running: list[Request], req: Request) -> None:
        bisect.insort_right(running, req, key=priority_key)


def new_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The waiting queue of a scheduling policy (ValueError naming the known ones otherwise)."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
