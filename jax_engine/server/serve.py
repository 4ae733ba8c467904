"""`jax-engine serve [MODEL]`: load the model and serve the OpenAI-compatible API with uvicorn.

SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish, then stops the engine loop.
If the engine loop dies, in-flight requests get an error, /health answers 503, and the server shuts down
and exits with status 1, so that a supervisor (systemd, Kubernetes) restarts it, as vLLM's server does.
"""

import argparse
import logging
import sys

from jax_engine.server.state import PREFIX_CACHE_ISOLATION, ServerConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
ENGINE_DIED_EXIT_STATUS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig("")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a .gguf file or HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health; repeat for several keys")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="largest n a request may ask for")
    parser.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests,
                        help="answer 503 to new requests while this many wait to start")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="answer 413 to request bodies larger than this")
    parser.add_argument("--prefix-cache-isolation", choices=PREFIX_CACHE_ISOLATION,
                        default=defaults.prefix_cache_isolation,
                        help="'api-key': requests hit only prefix-cache blocks computed for the same API key")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="answer 503 to new requests while this many connections are open")
    parser.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                        help="seconds a client has to send a request's headers")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--headless", action="store_true",
                        help="a worker host (--node-rank > 0): no HTTP server, only the driver's device calls")


def server_config(ns: argparse.Namespace, model_name: str) -> ServerConfig:
    return ServerConfig(model_name, tuple(ns.api_key), ns.max_n, ns.max_waiting_requests, ns.max_body_bytes,
                        ns.prefix_cache_isolation, ns.max_connections, ns.header_timeout)


def make_server(engine, config: ServerConfig, host: str, port: int, log_level: str = "info"):
    """The uvicorn server for the app, with the connection cap and the header deadline of `config`.

    If the engine loop dies, the server shuts down (`engine.on_dead`).
    """
    import uvicorn

    from jax_engine.server.app import build_app
    from jax_engine.server.limits import with_header_timeout

    server = uvicorn.Server(uvicorn.Config(build_app(engine, config), host=host, port=port, log_level=log_level,
                                           http=with_header_timeout(config.header_timeout),
                                           limit_concurrency=config.max_connections))

    def shut_down() -> None:
        logging.getLogger(__name__).error("the engine loop died: shutting the server down")
        server.should_exit = True

    engine.on_dead = shut_down
    return server


def run_server(engine, config: ServerConfig, host: str, port: int, log_level: str = "info") -> int:
    """Serve until SIGTERM / Ctrl-C (returns 0) or until the engine loop dies (returns 1)."""
    make_server(engine, config, host, port, log_level).run()
    return ENGINE_DIED_EXIT_STATUS if engine.dead_error is not None else 0


def main(ns: argparse.Namespace) -> None:
    from jax_engine.async_llm_engine import AsyncLLMEngine
    from jax_engine.config import EngineArgs

    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = EngineArgs.from_cli_args(ns, model=ns.model_tag or ns.model)
    if ns.headless != (args.node_rank > 0):
        raise ValueError("--headless goes with --node-rank > 0 (a worker host), and only there")
    if ns.headless:
        from jax_engine.llm_engine import LLMEngine

        LLMEngine(args).run_worker()
        return
    config = server_config(ns, ns.served_model_name or args.model or DEFAULT_MODEL_NAME)
    if args.data_parallel_size > 1:
        from jax_engine.distributed.data_parallel import DataParallelEngine

        engine = DataParallelEngine.from_engine_args(args)
    else:
        engine = AsyncLLMEngine.from_engine_args(args)
    status = run_server(engine, config, ns.host, ns.port, ns.log_level)
    if status:
        sys.exit(status)
