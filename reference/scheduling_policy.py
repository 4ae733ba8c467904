"""The order of the scheduler's queues: vLLM's `scheduling_policy`, "fcfs" or "priority".

"fcfs" serves requests in order of arrival. "priority" orders them by (priority, arrival): a lower priority
value runs first, is admitted first and is preempted last, and arrival breaks ties. Under "fcfs" every
request's priority is 0, so one sort key serves both policies.
"""

SCHEDULING_POLICIES = ("fcfs", "priority")


# --8<-- [start:queue_order]
def queue_order(request) -> tuple[int, int]:
    """A waiting, running or swapped request's sort key: served first if smallest."""
    return request.priority, request.arrival
# --8<-- [end:queue_order]


def check_priority(priority: int, policy: str) -> None:
    """A ValueError unless `priority` is an int, and 0 where the policy is not "priority" (vLLM's rule)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority must be 0 unless scheduling_policy is 'priority' (it is {policy!r}), "
                         f"got {priority}")
