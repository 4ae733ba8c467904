"""A contiguous KV cache, as the paper's Orca baselines allocate it: "We assume Orca uses the buddy allocation
algorithm to determine the memory address to store KV cache" (Section 6.1).

A buddy allocator hands out ranges of 2**k token slots, each aligned to its own size. A request for n slots takes
the smallest power of two at least n, split off a larger free range by halving; a released range merges with its
buddy (the other half of the range it was split from) whenever that half is free too. Two wastes follow:

- internal fragmentation: a reservation of 600 tokens holds 1024 slots (the paper's chatbot workload: a 1024-token
  prompt makes every Orca variant hold 2048, "regardless of how they predict the output lengths", Section 6.5);
- external fragmentation: free slots that are not one aligned range of the size the next request needs.

A cache of a size that is not a power of two is tiled by its binary digits, largest first (14,512 slots are
ranges of 8192, 4096, 2048, 128, 32 and 16), each aligned to its size, and no merge crosses them.
"""

import bisect


class BuddySpace:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.roots: list[tuple[int, int]] = []  # (start, order) of the top ranges, by start
        self.free: dict[int, set[int]] = {}  # order -> starts of the free ranges of 2**order slots
        start = 0
        for order in reversed(range(num_slots.bit_length())):
            if num_slots >> order & 1:
                self.roots.append((start, order))
                self.free.setdefault(order, set()).add(start)
                start += 1 << order
        self.held: dict[str, tuple[int, int]] = {}  # owner -> (start, order)

    @staticmethod
    def order_for(length: int) -> int:
        """The power of two a reservation of `length` slots takes: 600 -> 10 (1024 slots)."""
        return max(length - 1, 0).bit_length()

    def fits(self, length: int) -> bool:
        order = self.order_for(length)
        return any(starts for k, starts in self.free.items() if k >= order)

    def allocate(self, owner: str, length: int) -> None:
        """The lowest free range of the smallest order that holds `length` slots, halved down to size
        (fits() must be true)."""
        order = self.order_for(length)
        k = min(k for k, starts in self.free.items() if k >= order and starts)
        start = min(self.free[k])
        self.free[k].remove(start)
        while k > order:  # halve: keep the lower half, free the upper one
            k -= 1
            self.free.setdefault(k, set()).add(start + (1 << k))
        self.held[owner] = (start, order)

    def release(self, owner: str) -> None:
        """Give `owner`'s range back, merged with its buddy as long as the buddy is free."""
        start, order = self.held.pop(owner)
        root_order = self.roots[bisect.bisect(self.roots, (start, 64)) - 1][1]
        while order < root_order and (buddy := start ^ (1 << order)) in self.free.get(order, ()):
            self.free[order].remove(buddy)
            start, order = min(start, buddy), order + 1
        self.free.setdefault(order, set()).add(start)

    @property
    def num_free_slots(self) -> int:
        return sum(len(starts) << order for order, starts in self.free.items())
