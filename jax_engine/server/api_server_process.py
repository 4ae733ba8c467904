"""One API server of `jax-engine serve --api-server-count N` (started by api_servers.py): a whole server, on the
listening socket it is given, driving the shared engine core (one per data-parallel replica) through a socket
pair of its own to each.

Its arguments come pickled on stdin once its imports are done: (index, EngineArgs, ServerConfig, host, port, log
level, the listening socket's file descriptor, its (input, output) socket addresses to each engine core (one per
data-parallel replica), its ends of the start barrier's pipes: start_barrier.py). It exits with run_server's
status: 0 after a drain, 1 if the engine core died or refused its flags or model.
"""

import logging
import pickle
import signal
import socket
import sys

# Told to stop (the supervisor passes SIGTERM on) before it serves, it has nothing to drain: it exits 0, leaving the
# core if it has joined it (EngineCoreClient), where SIGTERM's default would end it with status -15, which the
# supervisor takes for a failure. Once it serves, uvicorn's handler drains it. First, before the long imports.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.engine_core.core_client import EngineCoreClient
from jax_engine.server.data_parallel import DataParallelEngine
from jax_engine.server.serve import run_server
from jax_engine.server.start_barrier import wait_for_the_others


def main() -> int | str:
    try:
        index, args, config, host, port, log_level, listener_fd, addresses, start_fds = pickle.load(sys.stdin.buffer)
    except EOFError:  # the supervisor exited before it wrote them
        return "API server: no arguments came (the `jax-engine serve` that started it is gone)"
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(levelname)s %(asctime)s api-server-{index} %(name)s: %(message)s")
    listener = socket.socket(fileno=listener_fd)
    try:  # one engine per core; each waits for its core, which all load at once
        engines = [AsyncLLMEngine(EngineCoreClient(args, log_level.upper(), shared_core=a)) for a in addresses]
    except (ValueError, FileNotFoundError) as error:  # the model or its tokenizer could not load (here, or in the
        # core): a line, as `jax-engine serve` prints it
        return f"jax-engine: error: {error}"
    engine = engines[0] if len(engines) == 1 else DataParallelEngine(engines)
    wait_for_the_others(start_fds)
    return run_server(engine, config, host, port, log_level, sockets=[listener])


if __name__ == "__main__":
    sys.exit(main())
