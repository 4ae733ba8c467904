"""The scheduler's queues (waiting, running, swapped): sequences in order of arrival, earliest first."""

import bisect

from jax_engine.sequence import Sequence


class ArrivalQueue:
    """Sequences kept sorted by arrival in a plain list: a binary search finds where to insert; inserting
    or popping the front shifts the list (a memmove, cheap at the queue lengths the engine sees)."""

    def __init__(self) -> None:
        self.items: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def insert(self, seq: Sequence) -> None:
        bisect.insort(self.items, seq, key=lambda r: r.arrival)

    def remove(self, seq: Sequence) -> None:
        self.items.remove(seq)
