"""Starting the engine core process, as early as `jax-engine serve` can.

The core's interpreter imports the engine (jax, flax, transformers: ~1.3 s here, warm) before it reads what to serve
from its stdin: the pickled (EngineArgs, each API server's (input, output) socket addresses, log level, replica).
So `jax-engine serve` starts it first thing (`start_early`, from cli.main, before any import of its own), and the
two processes' imports run at once, on different cores. `start_engine_core` then takes it (`take_core_process`)
and writes its arguments as soon as the flags are parsed, before the server's own imports, and EngineCoreClient
binds the sockets it will connect to. This module imports nothing of the engine's, so that starting early costs
nothing.
"""

import atexit
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

MULTIPROCESSING_ENV = "JAX_ENGINE_MULTIPROCESSING"  # vLLM's VLLM_ENABLE_V1_MULTIPROCESSING
CORE_MODULE = "jax_engine.engine_core.core"
# Words after which `jax-engine serve` runs no engine core process, or prints its help and exits.
_NO_CORE_WORDS = frozenset({"--no-engine-core-process", "--headless", "-h", "--help"})

_early: subprocess.Popen | None = None
_taking = threading.Lock()


def multiprocessing_by_default() -> bool:
    return os.environ.get(MULTIPROCESSING_ENV, "1") != "0"


def start_core_process() -> subprocess.Popen:
    """A fresh interpreter (no fork of this one's threads, no re-import of the caller's __main__) running core.py
    as `python -m` would, its garbage collector paused from the first import on (core.py freezes the heap once
    the engine is ready: jax_engine/gc_heap.py)."""
    boot = f"import gc, runpy; gc.disable(); runpy.run_module({CORE_MODULE!r}, run_name='__main__', alter_sys=True)"
    return subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE)


def start_early(argv: list[str]) -> None:
    """Start the core process now if `jax-engine ARGV` will serve with one, as far as its words tell before they are
    parsed; a core started here and not taken is stopped at exit (`discard_early`)."""
    global _early
    if argv[:1] == ["serve"] and multiprocessing_by_default() and not _NO_CORE_WORDS & set(argv):
        _early = start_core_process()
        atexit.register(discard_early)


def take_core_process() -> subprocess.Popen:
    """The core process started early, else a new one: it waits for its arguments on stdin. Data-parallel
    replicas take theirs from threads of their own: one of them gets the early one."""
    global _early
    with _taking:
        process, _early = _early, None
    return process if process is not None and process.poll() is None else start_core_process()


def discard_early() -> None:
    """Stop the core process started early, if nothing took it (the server runs its engine in its own process)."""
    global _early
    if _early is not None:
        _early.kill()
        _early.wait()
        _early = None


@dataclass(frozen=True)
class StartedCore:
    """A core process with its arguments, and the (input, output) socket addresses its client is to bind."""

    process: subprocess.Popen
    addresses: tuple[str, str]
    directory: str  # of mode 0700, holding the sockets: only this user reaches them


def start_engine_core(args, log_level: str, replica: int | None = None) -> StartedCore:
    """Give the core process (the one started early, else a new one) its arguments: it loads the model from now on,
    while the caller goes on (`jax-engine serve` imports its server) until EngineCoreClient waits for it. The core
    connects to its sockets before or after the client binds them (ZMQ retries every 100 ms), and its messages
    wait for the connection."""
    directory = tempfile.mkdtemp(prefix="jax-engine-core-")
    addresses = tuple(f"ipc://{os.path.join(directory, name)}" for name in ("inputs", "outputs"))
    process = take_core_process()
    process.stdin.write(pickle.dumps((args, [addresses], log_level, replica)))
    process.stdin.close()
    return StartedCore(process, addresses, directory)
