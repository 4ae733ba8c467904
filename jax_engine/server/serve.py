"""`jax-engine serve [MODEL]`: load the model and serve the OpenAI-compatible API with uvicorn.

SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish (for at most --shutdown-timeout
seconds, then disconnects their clients, which aborts them), stops the engine loop and exits with status 0. If
the engine loop dies, in-flight requests get an error, /health answers 503, and the server shuts down and exits
with status 1, so that a supervisor (systemd, Kubernetes) restarts it, as vLLM's server does.

The engine runs in a process of its own (jax_engine/engine_core/, as vLLM v1's engine core) unless
--no-engine-core-process; the server drives it through the same AsyncLLMEngine either way.
"""

import argparse
import contextlib
import importlib
import logging
import signal
import sys
import threading

from jax_engine.engine_core.launch import discard_early, start_engine_core
from jax_engine.server.server_config import ServerConfig
from jax_engine.server.serve_flags import server_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# What make_server imports (this module imports none of it, so that `serve` parses its flags quickly).
_SERVER_MODULES = ("uvicorn", "jax_engine.server.app", "jax_engine.server.connections")
ENGINE_DIED_EXIT_STATUS = 1


def make_server(engine, config: ServerConfig, host: str, port: int, log_level: str = "info"):
    """The uvicorn server for the app, with the connection limits and deadlines of `config`.

    If the engine loop dies, the server shuts down (`engine.on_dead`).
    """
    import uvicorn

    from jax_engine.server.app import build_app
    from jax_engine.server.connections import ConnectionLimits, DrainingServer, protocol_class

    limits = ConnectionLimits(config.max_connections, config.max_pending_connections, config.header_timeout,
                              config.send_timeout)
    # No limit_concurrency: uvicorn's cap counts every connection alike; the protocol class counts its own. No
    # WebSockets: the API has none, and an upgraded connection would leave the protocol class and its count.
    uvicorn_config = uvicorn.Config(build_app(engine, config), host=host, port=port,
                                    log_level=config.uvicorn_log_level or log_level, root_path=config.root_path,
                                    ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                                    ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs,
                                    access_log=not config.disable_uvicorn_access_log,
                                    http=protocol_class(limits, config.api_keys), ws="none")
    server = DrainingServer(uvicorn_config, config.shutdown_timeout)

    def shut_down() -> None:
        logging.getLogger(__name__).error("the engine loop died: shutting the server down")
        server.should_exit = True

    engine.on_dead = shut_down
    return server


def run_server(engine, config: ServerConfig, host: str, port: int, log_level: str = "info",
               sockets: list | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C (returns 0) or until the engine loop dies (returns 1); on `sockets` (already
    listening, as each of --api-server-count's servers is given) instead of binding host:port."""
    server = make_server(engine, config, host, port, log_level)
    with _signals_end_the_server_only():
        server.run(sockets=sockets)
    return ENGINE_DIED_EXIT_STATUS if engine.dead_error is not None else 0


@contextlib.contextmanager
def _signals_end_the_server_only():
    """uvicorn handles SIGTERM and SIGINT while it serves, then restores the handlers it found and raises the
    signal again, so that the process ends as if by the signal (status 143). A server that drained cleanly
    should exit 0, as documented: the handlers it finds ignore that second delivery."""
    if threading.current_thread() is not threading.main_thread():  # where uvicorn handles no signals either
        yield
        return
    caught = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in caught}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(ns: argparse.Namespace) -> None:
    from jax_engine.config import EngineArgs

    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = EngineArgs.from_cli_args(ns, model=ns.model_tag or ns.model)
    if ns.headless != (args.node_rank > 0):
        raise ValueError("--headless goes with --node-rank > 0 (a worker host), and only there")
    if ns.headless:
        from jax_engine.llm_engine import LLMEngine

        LLMEngine(args).run_worker()
        return
    config = server_config(ns, ns.served_model_name or [args.model or DEFAULT_MODEL_NAME])
    if config.lora_modules and not args.enable_lora:  # before the model loads
        raise ValueError("--lora-modules needs --enable-lora")
    if ns.api_server_count != 1:
        from jax_engine.server.api_servers import check_api_server_count, serve_with_api_servers

        check_api_server_count(ns.api_server_count, args, ns.engine_core_process)  # before the model loads
        sys.exit(serve_with_api_servers(ns.api_server_count, args, config, ns.host, ns.port, ns.log_level))
    engine = _engine(args, ns.engine_core_process, ns.log_level.upper())
    status = run_server(engine, config, ns.host, ns.port, ns.log_level)
    if status:
        sys.exit(status)


def _engine(args, core_process: bool, log_level: str):
    """The engine the server drives: in a process of its own (the default), or in this one."""
    if core_process:
        return _engine_in_core_processes(args, log_level)
    discard_early()  # cli.main may have started one, before the flags were parsed
    from jax_engine.async_llm_engine import AsyncLLMEngine
    from jax_engine.server.data_parallel import DataParallelEngine

    if args.data_parallel_size > 1:
        return DataParallelEngine.from_engine_args(args)
    return AsyncLLMEngine.from_engine_args(args)


def _engine_in_core_processes(args, log_level: str):
    """The engine core process is given its arguments first: it loads the model while this process imports the
    server (~1 s), and it has imported the engine by then."""
    started = start_engine_core(args, log_level) if args.data_parallel_size == 1 else None
    for module in _SERVER_MODULES:  # now, not once the core is ready
        importlib.import_module(module)
    from jax_engine.async_llm_engine import AsyncLLMEngine
    from jax_engine.engine_core.core_client import EngineCoreClient
    from jax_engine.server.data_parallel import DataParallelEngine

    if started is None:
        return DataParallelEngine.in_core_processes(args, log_level)
    return AsyncLLMEngine(EngineCoreClient(args, log_level, started=started))
