"""A contiguous KV cache, as systems before PagedAttention allocate it: each request's reservation is one range
of token slots, placed first-fit among the free ranges. A free range too short for the next request is external
fragmentation (the paper's Fig. 3): the memory is free, but not in one piece."""

import bisect


class ContiguousSpace:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free: list[tuple[int, int]] = [(0, num_slots)]  # (start, length), sorted by start, never adjacent
        self.held: dict[str, tuple[int, int]] = {}

    def fits(self, length: int) -> bool:
        return any(free >= length for _, free in self.free)

    def allocate(self, owner: str, length: int) -> None:
        """The first free range that holds `length` slots (fits() must be true)."""
        i = next(i for i, (_, free) in enumerate(self.free) if free >= length)
        start, free = self.free[i]
        self.free[i : i + 1] = [(start + length, free - length)] if free > length else []
        self.held[owner] = (start, length)

    def release(self, owner: str) -> None:
        """Give `owner`'s range back, merged with free neighbours."""
        start, length = self.held.pop(owner)
        i = bisect.bisect(self.free, (start, length))
        if i < len(self.free) and self.free[i][0] == start + length:  # merge with the range after
            length += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == start:  # and with the one before
            start, length = self.free[i - 1][0], self.free[i - 1][1] + length
            i -= 1
            self.free.pop(i)
        self.free.insert(i, (start, length))

    @property
    def num_free_slots(self) -> int:
        return sum(length for _, length in self.free)
