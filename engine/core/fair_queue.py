"""Weighted fair queueing across tenants.

Each tenant has its own queue (ordered by request priority, then arrival).
A backlogged tenant's head carries a virtual start tag, fixed when the tenant
became backlogged (max(global virtual time, its last finish)) or, while it
stays backlogged, equal to its previous finish; its finish tag is

    finish = start + cost / weight

and the smallest finish tag is served next (start-time fair queueing: the
global virtual time is the start tag of the item last served).  A tenant that
was idle does not bank credit, and a tenant at its cap is skipped without
losing its place.

The queue also keeps its items in push order, board-wide and per tenant
(`oldest`): the scheduler pushes a request when it arrives, so the oldest
item is the one that has waited longest, whatever the fair order serves next
(admission.max_queue_wait_ms expires waits in that order).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True)
class _Entry:
    sort_key: tuple[int, int]
    item_id: int = field(compare=False)
    cost: float = field(compare=False)


class _PushOrder:
    """Item ids oldest first, removed lazily: an entry is live while `tickets` still maps its item to its ticket
    (an id pushed again later gets a new ticket, so its old entry stays dead). Compacted when dead entries
    outnumber the live ones, so memory follows the queue even when nobody asks for the oldest."""

    __slots__ = ("_q", "live")

    def __init__(self) -> None:
        self._q: deque[tuple[int, int]] = deque()  # (ticket, item id)
        self.live = 0

    def append(self, ticket: int, item_id: int) -> None:
        self._q.append((ticket, item_id))
        self.live += 1

    def removed(self, tickets: dict[int, int]) -> None:
        """One of its items left the queue (its ticket is already gone from `tickets`)."""
        self.live -= 1
        if len(self._q) > 2 * self.live + 32:
            self._q = deque(e for e in self._q if tickets.get(e[1]) == e[0])

    def oldest(self, tickets: dict[int, int]) -> int | None:
        q = self._q
        while q and tickets.get(q[0][1]) != q[0][0]:
            q.popleft()
        return q[0][1] if q else None


class WeightedFairQueue:
    def __init__(self, weight_of: Callable[[str], float]) -> None:
        self._weight_of = weight_of
        self._queues: dict[str, list[_Entry]] = {}
        self._where: dict[int, str] = {}
        self._removed: set[int] = set()
        self._last_finish: dict[str, float] = {}
        self._start: dict[str, float] = {}  # start tag of each backlogged tenant's head
        self._vtime = 0.0
        self._counter = itertools.count()
        self._tickets: dict[int, int] = {}  # item id -> its push ticket (the _PushOrder entries' key)
        self._pushes = itertools.count()
        self._age = _PushOrder()
        self._tenant_age: dict[str, _PushOrder] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item_id: int) -> bool:
        return item_id in self._where

    def ids(self) -> list[int]:
        """Every queued item id, in no particular order (for statistics)."""
        return list(self._where)

    @property
    def virtual_time(self) -> float:
        return self._vtime

    def push(self, item_id: int, tenant: str, cost: float, priority: int = 0, front: bool = False) -> None:
        """Queue an item; `front` puts it ahead of its tenant's others (a requeued request)."""
        assert item_id not in self._where, f"item {item_id} queued twice"
        assert cost >= 0
        order = -next(self._counter) if front else next(self._counter)
        rank = -(1 << 62) if front else -priority
        if self._head(tenant) is None:  # the tenant becomes backlogged
            self._start[tenant] = max(self._vtime, self._last_finish.get(tenant, 0.0))
        heapq.heappush(self._queues.setdefault(tenant, []), _Entry((rank, order), item_id, float(cost)))
        self._where[item_id] = tenant
        self._removed.discard(item_id)
        ticket = self._tickets[item_id] = next(self._pushes)
        self._age.append(ticket, item_id)
        ages = self._tenant_age.get(tenant)
        if ages is None:
            ages = self._tenant_age[tenant] = _PushOrder()
        ages.append(ticket, item_id)

    def _forget_age(self, item_id: int, tenant: str) -> None:
        tickets = self._tickets
        del tickets[item_id]
        self._age.removed(tickets)
        ages = self._tenant_age[tenant]
        ages.removed(tickets)
        if not ages.live:
            del self._tenant_age[tenant]

    def oldest(self, tenant: str | None = None) -> int | None:
        """The queued item pushed first, board-wide or among `tenant`'s (None: nothing queued there).

        Amortised O(1): dead entries at the front are dropped as they are met."""
        if tenant is None:
            return self._age.oldest(self._tickets)
        ages = self._tenant_age.get(tenant)
        return None if ages is None else ages.oldest(self._tickets)

    def remove(self, item_id: int) -> bool:
        if item_id not in self._where:
            return False
        tenant = self._where.pop(item_id)
        self._removed.add(item_id)  # lazily dropped from its heap
        self._forget_age(item_id, tenant)
        if self._head(tenant) is None:
            self._start.pop(tenant, None)
        return True

    def _head(self, tenant: str) -> _Entry | None:
        q = self._queues.get(tenant)
        while q and q[0].item_id in self._removed:
            self._removed.discard(heapq.heappop(q).item_id)
        return q[0] if q else None

    def tag(self, tenant: str, cost: float) -> tuple[float, float]:
        """(start, finish) virtual tags of the tenant's head if it costs `cost`."""
        start = self._start.get(tenant)
        if start is None:
            start = max(self._last_finish.get(tenant, 0.0), self._vtime)
        return start, start + cost / self._weight_of(tenant)

    def peek(self, eligible: Callable[[str, int], bool] = lambda t, i: True) -> tuple[int, str] | None:
        """The (item, tenant) with the smallest finish tag among eligible heads."""
        best: tuple[float, int, int, str] | None = None
        for tenant in list(self._queues):
            head = self._head(tenant)
            if head is None:
                del self._queues[tenant]
                self._start.pop(tenant, None)
                continue
            if not eligible(tenant, head.item_id):
                continue
            _, finish = self.tag(tenant, head.cost)
            if best is None or (finish, head.sort_key[1]) < best[:2]:
                best = (finish, head.sort_key[1], head.item_id, tenant)
        return None if best is None else (best[2], best[3])

    def pop(self, item_id: int) -> float:
        """Serve `item_id` (which must be its tenant's head); returns its finish tag."""
        tenant = self._where[item_id]
        head = self._head(tenant)
        assert head is not None and head.item_id == item_id, "only a tenant's head can be served"
        heapq.heappop(self._queues[tenant])
        del self._where[item_id]
        self._forget_age(item_id, tenant)
        start, finish = self.tag(tenant, head.cost)
        self._last_finish[tenant] = finish
        self._vtime = max(self._vtime, start)
        if self._head(tenant) is None:
            self._start.pop(tenant, None)
        else:
            self._start[tenant] = finish
        return finish

    def items(self) -> list[int]:
        return list(self._where)

    def tenant_of(self, item_id: int) -> str:
        return self._where[item_id]
