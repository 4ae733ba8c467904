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
"""

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Tenant = str | None  # None: requests without an API key (or a server without keys)


class FairQueue(Generic[Item]):
    def __init__(self) -> None:
        self._queues: OrderedDict[Tenant, OrderedDict[str, Item]] = OrderedDict()  # in turn order
        self._tenant_of: dict[str, Tenant] = {}

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tenant_of

    def count(self, tenant: Tenant) -> int:
        return len(self._queues.get(tenant, ()))

    @property
    def tenants(self) -> set[Tenant]:
        return set(self._queues)

    def push(self, tenant: Tenant, request_id: str, item: Item) -> None:
        self._queues.setdefault(tenant, OrderedDict())[request_id] = item
        self._tenant_of[request_id] = tenant

    def remove(self, request_id: str) -> bool:
        """Forget a queued request (aborted before it entered the engine); False if it is not queued."""
        tenant = self._tenant_of.pop(request_id, None)
        if request_id not in self._queues.get(tenant, {}):
            return False
        del self._queues[tenant][request_id]
        if not self._queues[tenant]:
            del self._queues[tenant]
        return True

    def pop_next(self, may_enter: Callable[[Tenant], bool]) -> tuple[Tenant, str, Item] | None:
        """The oldest request of the first tenant in turn that `may_enter`; that tenant's turn then goes to the
        back. None if no tenant may."""
        for tenant in list(self._queues):
            if may_enter(tenant):
                queue = self._queues.pop(tenant)
                request_id, item = queue.popitem(last=False)
                if queue:
                    self._queues[tenant] = queue  # to the back of the turn order
                del self._tenant_of[request_id]
                return tenant, request_id, item
        return None

    def items(self) -> list[tuple[str, Item]]:
        return [(rid, item) for queue in self._queues.values() for rid, item in queue.items()]
