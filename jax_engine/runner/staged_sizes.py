"""The sizes a runner's programs are ready for while start-up still compiles the others.

A cold server compiles only a coarse cover of each dimension's sizes before it answers /health (every few
tokens, rows sampled, blocks copied or swapped: compile_shapes.py), then the rest in the background. Until a size's
programs are all compiled, the runner pads to the next size that is ready, so no call waits for a compile
and none compiles a program of its own; outputs do not change, since padding never does. The sizes steps
have padded past compile first, while steps run (`wanted`); the others when none does.

    dimension       sizes (the default limits)        ready first (at most x4, x8, x4)   for example
    tokens          1, 2, 4, 8, 16, 20, 24, ... 2048   1, 4, 20, 96, 448, 2048            8 -> 20 tokens
    rows            1, 2, 4, ... 256                   1, 16, 256                          2 -> 16 rows
    blocks copied   8, 16, ... 256                     8, 32, 256                          16 -> 32 blocks
    blocks swapped  8, 16, ... the cache's blocks      the same way, at most x4
"""

import bisect
from collections import Counter


class StagedSizes:
    def __init__(self, sizes: dict[str, set[int]] | None = None, pending: dict[tuple, tuple[str, int]] | None = None):
        """`sizes`: each dimension's start-up sizes; `pending`: the programs still to come, by key, with the
        (dimension, size) each serves. A size is ready once none of its programs is pending."""
        self._pending = dict(pending or {})
        self._left = Counter(self._pending.values())
        self._asked: set[tuple[str, int]] = set()  # pending sizes a call has asked for
        waiting = {dimension for dimension, _ in self._left}
        # Replaced, never changed in place: the engine's thread reads these while the compiling thread updates.
        self._ready = {dimension: sorted(size for size in (sizes or {}).get(dimension, ())
                                         if (dimension, size) not in self._left)
                       for dimension in waiting}

    def padded(self, dimension: str, size: int) -> int:
        """`size`, or while some of its dimension's programs are still compiling, the smallest ready size above
        it (none: `size` itself, which compiles on first use as any shape start-up did not list)."""
        ready = self._ready.get(dimension)
        if ready is None:
            return size
        if (dimension, size) in self._left:
            self._asked.add((dimension, size))
        i = bisect.bisect_left(ready, size)
        return ready[i] if i < len(ready) else size

    def wanted(self, key: tuple) -> bool:
        """Whether a call has asked for the size the pending program of `key` serves: the compiling thread takes
        those first, so a burst of requests soon runs at the sizes it needs."""
        return self._pending.get(key) in self._asked

    def done(self, key: tuple) -> None:
        """The program for `key` is compiled (or given up on): its size is ready once its group's last is."""
        group = self._pending.pop(key, None)
        if group is None:
            return
        self._left[group] -= 1
        if self._left[group] > 0:
            return
        del self._left[group]
        dimension, size = group
        if any(waiting == dimension for waiting, _ in self._left):
            self._ready = {**self._ready, dimension: sorted([*self._ready[dimension], size])}
        else:  # every size of the dimension is ready: no more padding
            self._ready = {d: ready for d, ready in self._ready.items() if d != dimension}

    @property
    def complete(self) -> bool:
        return not self._pending
