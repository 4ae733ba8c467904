"""The model runner's device programs: every device call goes through here, so their number is bounded.

    start-up (compile_shapes.py)  ->  startup[key]   compiled (or loaded) before the first request: every
                                                     shape a request can take on the ragged layout
    a key start-up did not list   ->  jax.jit        compiled on first use, logged with its cause; at most
                                                     max_late_programs such keys, then JAX's caches are emptied

Each compiled program holds machine code, memory maps and a few MB of host memory. Through `jax.jit` alone,
every new shape a request chose compiled a program that was never freed: a few hundred requests of distinct
sampler options exhausted the kernel's memory maps and LLVM failed. Start-up now lists every shape a request
can take on the ragged layout, so late programs are the padded layouts' (xla, pallas) and enforce_eager's, and
the cap bounds those too. They run through jit, whose cache engines in one process share (tests build dozens).
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import jax

logger = logging.getLogger(__name__)

# Late programs kept at once: the padded layouts and enforce_eager compile every step shape late, about 20-60
# in a long mixed run of the default limits.
MAX_LATE_PROGRAMS = 64


class ProgramCache:
    def __init__(self, max_late_programs: int = MAX_LATE_PROGRAMS) -> None:
        self.startup: dict[tuple, jax.stages.Compiled] = {}  # by key
        self.late: OrderedDict[tuple, None] = OrderedDict()  # keys compiled after start-up, least recent first
        self.max_late_programs = max_late_programs
        self.num_late_compiles = 0
        self.late_compile_seconds = 0.0
        self.num_evictions = 0

    def call(self, key: tuple, fn: Callable, args: tuple, kwargs: dict | None = None, static: tuple = (),
             cause: str = ""):
        """Run the program for `key` on `args` and `kwargs`: start-up's, or `fn` through jit with the trailing
        `static` arguments (compiled on its first use, then logged with `cause`: what made this shape)."""
        kwargs = kwargs or {}
        program = self.startup.get(key)
        if program is not None:
            return program(*args, **kwargs)
        if key in self.late:
            self.late.move_to_end(key)
            return fn(*args, *static, **kwargs)
        started = time.perf_counter()
        result = jax.block_until_ready(fn(*args, *static, **kwargs))
        seconds = time.perf_counter() - started
        self.num_late_compiles += 1
        self.late_compile_seconds += seconds
        logger.info("compiled %s after start-up in %.2f s (%s); %d late programs", key[0], seconds,
                    cause or "a shape start-up did not list", len(self.late) + 1)
        self.late[key] = None
        if len(self.late) > self.max_late_programs:
            self._evict()
        return result

    def _evict(self) -> None:
        """Forget the least recently used half of the late programs, and free every late program.

        jit keeps each executable in JAX's caches (its own, and weakref LRU caches of up to 2,048 lowerings
        and compilations), ~9 memory maps apiece, and dropping one program from them is not possible:
        jax.clear_caches() empties them all. Start-up's programs, held here, are unaffected; the late ones
        still in use compile again (from JAX's persistent cache) on their next call. Halving the count makes
        that rare."""
        while len(self.late) > self.max_late_programs // 2:
            self.late.popitem(last=False)
            self.num_evictions += 1
        jax.clear_caches()

    @property
    def num_programs(self) -> int:
        return len(self.startup) + len(self.late)
