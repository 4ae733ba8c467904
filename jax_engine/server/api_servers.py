"""`jax-engine serve --api-server-count N`: N API server processes on the engine core (or, with
`--data-parallel-size R`, on each of R cores), as vLLM v1 scales out the front end (HTTP, checks, tokenization,
streaming) once one Python process cannot keep up with the engine.

    supervisor (`jax-engine serve`)   binds --port, starts the others, watches them, passes SIGTERM on
      ├── engine core(s) 0 .. R-1     the scheduler and the model (engine_core/core.py), a socket pair per API server;
      │                               core r runs data-parallel replica r on its own devices
      └── API servers 0 .. N-1        each a whole server (api_server_process.py) accepting connections on the one
                                      listening socket it was given: the kernel hands each connection to one of them
                                      (all start accepting together: start_barrier.py)

Each API server has its own connection limits and /health; the engine is shared: each core sends each API server
its own requests' outputs and all of them the engine's state, so a full queue's 503 counts every API server's
waiting requests, and with R cores each API server sends a new request to the core with the fewest unfinished
requests of all API servers (server/data_parallel.py). /metrics sums the API servers' counters and histograms
(prometheus_client's multiprocess mode, as vLLM's); the gauges are the engines'.

It ends as one server does. SIGTERM (or Ctrl-C) drains every API server; each then leaves the cores, which stop
once all have: status 0. If a core dies, the supervisor tells each API server so (the "dead" message a core sends
itself when its loop fails); they fail their requests in flight and exit, and the supervisor exits 1. If an API
server dies, it stops the others and the cores and exits 1.
"""

import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import zmq

from jax_engine.engine_core.launch import take_core_process
from jax_engine.engine_core.messages import encode
from jax_engine.server.lora_adapters import RUNTIME_UPDATES_ENV, runtime_updates_allowed
from jax_engine.server.start_barrier import StartBarrier

logger = logging.getLogger(__name__)
API_SERVER_MODULE = "jax_engine.server.api_server_process"
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's: where each process keeps its counts
WATCH_S = 0.2  # how often the supervisor looks at its processes
STOP_WAIT_S = 30.0  # how long it waits for a process told to stop before it kills it
LAST_WORD_MS = 2000  # how long it tries to deliver the news of the core's death


def check_api_server_count(count: int, args, core_process: bool) -> None:
    """A ValueError naming the flag if `count` API servers cannot serve this engine."""
    if count < 1:
        raise ValueError(f"--api-server-count must be at least 1 (got {count})")
    if count > (cores := os.cpu_count() or 1):  # each is a Python process: more than the cores cannot serve faster
        raise ValueError(f"--api-server-count must be at most the {cores} CPU cores of this machine (got {count})")
    if count > 1 and not core_process:
        raise ValueError("--api-server-count > 1 needs the engine core process (--engine-core-process)")
    # Each API server numbers the adapters of --lora-modules alike, in their order; one loaded at run time would
    # reach only the API server its request came to, and take a number the others give another adapter.
    if count > 1 and args.enable_lora and runtime_updates_allowed():
        raise ValueError(f"--api-server-count > 1 serves the adapters of --lora-modules, not run-time LoRA updates "
                         f"({RUNTIME_UPDATES_ENV}): a load would reach one API server only")


def serve_with_api_servers(count: int, args, config, host: str, port: int, log_level: str) -> int:
    """Run the engine core (one per data-parallel replica) and `count` API servers on host:port; return 0 after a
    drain, 1 after a death."""
    try:
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=2048)  # uvicorn's backlog
    except OSError as error:  # before anything has started: a message, as for any bad flag
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
    directory = tempfile.mkdtemp(prefix="jax-engine-serve-")  # mode 0700: only this user reaches the sockets
    replicas = args.data_parallel_size
    # addresses[r][i]: API server i's (input, output) sockets to core r
    addresses = [[(f"ipc://{directory}/inputs-{r}-{i}", f"ipc://{directory}/outputs-{r}-{i}") for i in range(count)]
                 for r in range(replicas)]
    os.mkdir(metrics_dir := os.path.join(directory, "metrics"))
    cores = [_given(take_core_process(), (args, addresses[r], log_level.upper(), r if replicas > 1 else None))
             for r in range(replicas)]
    barrier = StartBarrier(count)
    servers = [_given(subprocess.Popen([sys.executable, "-m", API_SERVER_MODULE], stdin=subprocess.PIPE,
                                       pass_fds=(listener.fileno(), *barrier.child_fds),
                                       env={**os.environ, METRICS_DIR_ENV: metrics_dir}),
                      (i, args, _logs_stats_if_first(config, i), host, port, log_level, listener.fileno(),
                       [a[i] for a in addresses], barrier.child_fds))
               for i in range(count)]
    listener.close()  # the API servers hold it
    barrier.started()
    logger.info("%d API servers on %s:%d, %d engine core%s", count, host, port, replicas, "s" * (replicas > 1))
    try:
        with _sigterm_passed_on(servers):
            return _watch(cores, servers, addresses, barrier)
    finally:
        for process in [*servers, *cores]:
            if process.poll() is None:
                process.kill()
                process.wait()
        barrier.close()
        shutil.rmtree(directory, ignore_errors=True)


def _logs_stats_if_first(config, index: int):
    """The first API server alone logs the periodic stats line (it counts every server's tokens): one line, not N."""
    return config if index == 0 else dataclasses.replace(config, disable_log_stats=True)


def _given(process: subprocess.Popen, arguments: tuple) -> subprocess.Popen:
    """`process`, once its arguments are written to its stdin (it reads them after its imports)."""
    process.stdin.write(pickle.dumps(arguments))
    process.stdin.close()
    return process


def _watch(cores: list[subprocess.Popen], servers: list[subprocess.Popen], addresses: list[list[tuple[str, str]]],
           barrier: StartBarrier) -> int:
    while True:
        statuses, core_statuses = [s.poll() for s in servers], [c.poll() for c in cores]  # each read once per round
        if 0 in core_statuses:  # a core stops once every API server has left it, and may exit before they do
            _stop(*servers)
            statuses = [server.returncode for server in servers]
        if all(status == 0 for status in statuses):  # drained: each left the cores, which stop once all have
            _stop(*cores)
            return 0
        if dead := [(r, status) for r, status in enumerate(core_statuses) if status not in (None, 0)]:
            logger.error("the engine core process exited with status %d: stopping the API servers", dead[0][1])
            _tell_core_died([a for r, _ in dead for a in addresses[r]],
                            f"the engine core process exited with status {dead[0][1]}")
            # Serving, an idle API server reads nothing from the core until a request comes. Still starting, each
            # waits for its cores and prints why one could not start: SIGTERM could end it before it does.
            if barrier.released:
                _terminate(servers)
            _stop(*servers)
            return 1
        if failed := [(i, status) for i, status in enumerate(statuses) if status not in (None, 0)]:
            logger.error("API server %d exited with status %d: stopping the others", *failed[0])
            _terminate(servers)
            _stop(*servers)
            # The cores are killed on the way out (serve_with_api_servers): they would wait for the failed one's
            # "shutdown", which won't come.
            return 1
        barrier.wait(WATCH_S)  # and lets the API servers accept once all are ready


def _terminate(servers: list[subprocess.Popen]) -> None:
    """SIGTERM to the API servers still running: they drain, and leave the core."""
    for server in servers:
        if server.poll() is None:
            server.terminate()


def _stop(*processes: subprocess.Popen) -> None:
    """Wait for `processes` to exit, killing those still there after STOP_WAIT_S (in all)."""
    deadline = time.monotonic() + STOP_WAIT_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.error("process %d did not stop within %.0f s: killing it", process.pid, STOP_WAIT_S)
            process.kill()
            process.wait()


def _tell_core_died(addresses: list[tuple[str, str]], why: str) -> None:
    """Send each API server what the core sends when its loop dies, on the socket it reads the core on."""
    context = zmq.Context()
    for _, outputs in addresses:
        pusher = context.socket(zmq.PUSH)
        # Set now, not by destroy(): the loop drops each socket, whose close would otherwise wait for ever to
        # deliver to an API server that has already exited.
        pusher.setsockopt(zmq.LINGER, LAST_WORD_MS)
        pusher.connect(outputs)
        pusher.send(encode("dead", why))
    context.destroy(linger=LAST_WORD_MS)


@contextlib.contextmanager
def _sigterm_passed_on(servers: list[subprocess.Popen]):
    """SIGTERM or SIGINT to the supervisor drains the API servers (SIGTERM, once: a second SIGINT would make
    uvicorn quit without draining). Ctrl-C reaches them all anyway, as the process group's SIGINT."""
    passed = False

    def pass_on(*_) -> None:
        nonlocal passed
        if not passed:
            passed = True
            _terminate(servers)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
