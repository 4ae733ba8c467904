"""Requests waiting to enter the engine, queued per tenant (an API key) and let in by turns, each tenant up to
its share of the batch.

    tenant A: a1 a2 a3 a4 ...      the engine loop, before each step:
    tenant B: b1                     let in the next request of each tenant in turn (A, B, A, ...), while
    tenant C: c1 c2                  the tenant holds fewer than max_num_seqs / active tenants sequences

The engine's scheduler serves what it holds first come, first served (the oracle's policy). Left to itself
that lets one client's burst (many prompts x n=16 x long outputs in one small request) fill the batch and the
waiting queue, and another client's 5-token request waited 47.5 s. Here a burst waits in its own tenant's
queue, outside the engine, while every other tenant's requests go in at their turn. One tenant alone gets
the whole batch: the share only divides what several want.

A tenant's own requests go in lowest priority value first, then in order of arrival: the order the engine's
scheduler keeps under scheduling_policy "priority" (all are 0 under "fcfs").
"""

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Tenant = str | None  # None: requests without an API key (or a server without keys)


class FairQueue(Generic[Item]):
    def __init__(self) -> None:
        # In turn order: each tenant's requests by priority, each priority's in order of arrival.
        self._queues: OrderedDict[Tenant, dict[int, OrderedDict[str, Item]]] = OrderedDict()
        self._place: dict[str, tuple[Tenant, int]] = {}  # request id -> its tenant and priority

    def __len__(self) -> int:
        return len(self._place)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._place

    def count(self, tenant: Tenant) -> int:
        return sum(map(len, self._queues.get(tenant, {}).values()))

    @property
    def tenants(self) -> set[Tenant]:
        return set(self._queues)

    def push(self, tenant: Tenant, request_id: str, item: Item, priority: int = 0) -> None:
        self._queues.setdefault(tenant, {}).setdefault(priority, OrderedDict())[request_id] = item
        self._place[request_id] = (tenant, priority)

    def remove(self, request_id: str) -> bool:
        """Forget a queued request (aborted before it entered the engine); False if it is not queued."""
        if request_id not in self._place:
            return False
        tenant, priority = self._place.pop(request_id)
        del self._queues[tenant][priority][request_id]
        self._drop_empty(tenant, priority)
        return True

    def pop_next(self, may_enter: Callable[[Tenant], bool]) -> tuple[Tenant, str, Item] | None:
        """The first request (lowest priority, then oldest) of the first tenant in turn that `may_enter`; that
        tenant's turn then goes to the back. None if no tenant may."""
        for tenant in list(self._queues):
            if may_enter(tenant):
                self._queues.move_to_end(tenant)  # to the back of the turn order
                priority = min(self._queues[tenant])
                request_id, item = self._queues[tenant][priority].popitem(last=False)
                del self._place[request_id]
                self._drop_empty(tenant, priority)
                return tenant, request_id, item
        return None

    def _drop_empty(self, tenant: Tenant, priority: int) -> None:
        if not self._queues[tenant][priority]:
            del self._queues[tenant][priority]
        if not self._queues[tenant]:
            del self._queues[tenant]
