"""The scheduler's queues (waiting, running, swapped): sequences in the policy's order (reference/scheduling_policy.py:
arrival, or priority then arrival), first first."""

import bisect

from jax_engine.sequence import Sequence
from reference.scheduling_policy import queue_order


class ArrivalQueue:
    """Sequences kept sorted (queue_order) in a plain list: a binary search finds where to insert; inserting
    or popping the front shifts the list (a memmove, cheap at the queue lengths the engine sees)."""

    def __init__(self) -> None:
        self.items: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def insert(self, seq: Sequence) -> None:
        bisect.insort(self.items, seq, key=queue_order)

    def remove(self, seq: Sequence) -> None:
        self.items.remove(seq)
