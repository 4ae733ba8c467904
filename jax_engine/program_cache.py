"""The model runner's compiled programs: every device call goes through here, so their number is bounded.

    start-up (compile_shapes.py)  ->  startup[key]    kept for good: every shape a request can take
    a key start-up did not list   ->  late[key]       compiled on first use, logged with its cause; at most
                                                      max_late_programs, the least recently used evicted

Each compiled program holds machine code, memory maps and a few MB of host memory. Through `jax.jit` alone,
every new shape a request chose compiled a program that was never freed (a few hundred requests of distinct
sampler options exhausted the kernel's memory maps and LLVM failed). Start-up now lists every shape a request
can take on the ragged layout, so late programs are the padded layouts' and enforce_eager's; the cap bounds
them too.
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import jax

logger = logging.getLogger(__name__)

# Programs compiled after start-up kept at once: the padded layouts (xla, pallas) and enforce_eager compile
# every step shape late, about 20-60 in a long mixed run of the default limits.
MAX_LATE_PROGRAMS = 64


class ProgramCache:
    def __init__(self, max_late_programs: int = MAX_LATE_PROGRAMS) -> None:
        self.startup: dict[tuple, jax.stages.Compiled] = {}  # by key
        self.late: OrderedDict[tuple, jax.stages.Compiled] = OrderedDict()
        self.max_late_programs = max_late_programs
        self.num_late_compiles = 0
        self.late_compile_seconds = 0.0
        self.num_evictions = 0

    def get(self, key: tuple, fn: Callable, args: tuple, kwargs: dict | None = None, static: tuple = (),
            cause: str = "") -> jax.stages.Compiled:
        """The program for `key`: start-up's, or one compiled now from `fn` lowered with `args`, `static` and
        `kwargs` (then logged with `cause`: what about the request made this shape)."""
        program = self.startup.get(key)
        if program is not None:
            return program
        program = self.late.get(key)
        if program is not None:
            self.late.move_to_end(key)
            return program
        started = time.perf_counter()
        program = fn.lower(*args, *static, **(kwargs or {})).compile()
        seconds = time.perf_counter() - started
        self.num_late_compiles += 1
        self.late_compile_seconds += seconds
        logger.info("compiled %s after start-up in %.2f s (%s); %d late programs", key[0], seconds,
                    cause or "a shape start-up did not list", len(self.late) + 1)
        self.late[key] = program
        if len(self.late) > self.max_late_programs:
            self._evict()
        return program

    def _evict(self) -> None:
        """Drop the least recently used half of the late programs, and free them.

        NOTE: dropping our reference is not enough: JAX's lowering and compilation caches (weakref LRU caches of
        up to 2,048 entries) keep each executable alive, ~9 memory maps apiece. jax.clear_caches() empties them;
        the programs held here (start-up's among them) are unaffected, and any function called through jit
        directly traces again on its next call. Halving the cache makes that rare."""
        while len(self.late) > self.max_late_programs // 2:
            self.late.popitem(last=False)
            self.num_evictions += 1
        jax.clear_caches()

    @property
    def num_programs(self) -> int:
        return len(self.startup) + len(self.late)
