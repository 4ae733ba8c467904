"""The model runner's device programs: every device call goes through here, so their number is bounded.

    start-up (compile_shapes.py)  ->  startup[key]   compiled (or loaded) before the first request: every
                                                     shape a request can take on the ragged layout; a
                                                     server's are loaded in the background (see below)
    a key start-up did not list   ->  jax.jit        compiled on first use, logged with its cause; at most
                                                     max_late_programs such keys, then JAX's caches are emptied

Each compiled program holds machine code, memory maps and a few MB of host memory. Through `jax.jit` alone,
every new shape a request chose compiled a program that was never freed: a few hundred requests of distinct
sampler options exhausted the kernel's memory maps and LLVM failed. Start-up now lists every shape a request
can take on the ragged layout, so late programs are the padded layouts' (xla, pallas) and enforce_eager's, and
the cap bounds those too. They run through jit, whose cache engines in one process share (tests build dozens).

A server that finds all its start-up programs stored loads them on a thread of its own once it is ready
(`load_in_background`): ~1.2 s of CPU for the default model's 85, which a server would otherwise spend before it
answers /health. A call that needs one not loaded yet loads it at once (~15-50 ms), or waits for the thread to
finish loading it: nothing compiles, and each program is loaded once. A cold server compiles some of them on
that thread too, and its runner pads to the sizes already compiled meanwhile (`sizes`, staged_sizes.py).
"""

import atexit
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

import jax

from jax_engine.runner.staged_sizes import StagedSizes

logger = logging.getLogger(__name__)

# Late programs kept at once: the padded layouts and enforce_eager compile every step shape late, about 20-60
# in a long mixed run of the default limits.
MAX_LATE_PROGRAMS = 64
# Start-up's programs load in the background only once no program has run for this long.
IDLE_BEFORE_LOADING_S = 0.1


class ProgramCache:
    def __init__(self, max_late_programs: int = MAX_LATE_PROGRAMS) -> None:
        self.startup: dict[tuple, jax.stages.Compiled] = {}  # by key
        self.late: OrderedDict[tuple, None] = OrderedDict()  # keys compiled after start-up, least recent first
        self.max_late_programs = max_late_programs
        self.num_late_compiles = 0
        self.late_compile_seconds = 0.0
        self.num_evictions = 0
        self._loading: dict[tuple, tuple[Future, Callable]] = {}  # by key: start-up's programs not yet loaded
        self._last_call = 0.0  # time.monotonic() of the last call
        self.sizes = StagedSizes()  # every size is ready, but while a cold server compiles some (staged_sizes.py)

    def load_in_background(self, loads: dict[tuple, Callable[[], jax.stages.Compiled | None]],
                           when_done: Callable[[], None] = lambda: None, sizes: StagedSizes | None = None) -> None:
        """Load start-up's programs on a thread of their own, in the order of `loads` (a key's loader returns its
        program, or None when it cannot: that key then compiles on first use), then call `when_done`.

        Loaders that compile come with `sizes`: which sizes are ready as they finish. Steps pad to those meanwhile
        and call for none of the others, so those that serve a size a step padded past go first, whatever runs;
        the rest, as stored ones, wait for a moment when no program runs.

        At exit the thread stops after the program it is loading (the interpreter must not end under it), and
        does not hold the process up for the rest."""
        self._loading = {key: (Future(), load) for key, load in loads.items()}
        if sizes is not None:
            self.sizes = sizes
        stop = threading.Event()
        thread = threading.Thread(target=self._load_all, args=(list(self._loading.items()), stop, when_done),
                                  name="program-loader", daemon=True)
        thread.start()

        def stop_loading() -> None:
            stop.set()
            thread.join()

        atexit.register(stop_loading)

    def _load_all(self, loading: list, stop: threading.Event, when_done: Callable[[], None]) -> None:
        while loading and not stop.is_set():
            # In the given order, but first the sizes steps have padded past (StagedSizes.wanted): those go at
            # once; the others only while no program runs (the steps have both cores).
            loading.sort(key=lambda item: not self.sizes.wanted(item[0]))  # stable
            key, (future, load) = loading[0]
            if not self.sizes.wanted(key) and time.monotonic() - self._last_call < IDLE_BEFORE_LOADING_S:
                time.sleep(IDLE_BEFORE_LOADING_S)
                continue
            loading.pop(0)
            if not future.set_running_or_notify_cancel():  # a call took it first (`_started`)
                continue
            try:
                future.set_result(self._load(key, load))
            except BaseException as error:  # the call waiting for it raises it, rather than waiting forever
                logger.warning("start-up's program %s could not be loaded: %r", key[0], error)
                future.set_exception(error)
        if not stop.is_set():
            when_done()

    def _load(self, key: tuple, load: Callable) -> jax.stages.Compiled | None:
        try:
            program = load()
            if program is not None:
                self.startup[key] = program
        finally:  # a program that failed to compile is a shape start-up did not list: its size need not wait
            self._loading.pop(key, None)
            self.sizes.done(key)
        return program

    def _started(self, key: tuple) -> jax.stages.Compiled | None:
        """Start-up's program for `key`, loaded now if the background thread has not begun it."""
        loading = self._loading.get(key)
        if loading is None:  # none of start-up's, or loaded since the caller looked
            return self.startup.get(key)
        future, load = loading
        return self._load(key, load) if future.cancel() else future.result()

    def __contains__(self, key: tuple) -> bool:
        """Whether start-up provides the program for `key` (loaded or still loading)."""
        return key in self.startup or key in self._loading

    def call(self, key: tuple, fn: Callable, args: tuple, kwargs: dict | None = None, static: tuple = (),
             cause: str = ""):
        """Run the program for `key` on `args` and `kwargs`: start-up's, or `fn` through jit with the trailing
        `static` arguments (compiled on its first use, then logged with `cause`: what made this shape)."""
        kwargs = kwargs or {}
        self._last_call = time.monotonic()
        program = self._started(key)
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
