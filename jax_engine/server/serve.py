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
import dataclasses
import importlib
import json
import logging
import signal
import sys
import threading

from jax_engine.chat_template import load_chat_template
from jax_engine.engine_core.launch import (MULTIPROCESSING_ENV, discard_early, multiprocessing_by_default,
                                           start_engine_core)
from jax_engine.server.lora_adapters import parse_lora_module
from jax_engine.server.reasoning import REASONING_PARSERS
from jax_engine.server.server_config import (PREFIX_CACHE_ISOLATION, TOOL_CALL_PARSERS, ServerConfig,
                                             add_chat_template_argument, log_stats_interval)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# What make_server imports (this module imports none of it, so that `serve` parses its flags quickly).
_SERVER_MODULES = ("uvicorn", "jax_engine.server.app", "jax_engine.server.connections")
ENGINE_DIED_EXIT_STATUS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig("")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a .gguf file or HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health; repeat for several keys")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name(s) clients use (default: MODEL); answers give the first")
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="largest n a request may ask for")
    parser.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests,
                        help="answer 503 to new requests while this many wait to start")
    parser.add_argument("--max-waiting-per-key", type=int, default=defaults.max_waiting_per_key,
                        help="answer 503 to an API key's new requests while this many of its own wait to start "
                        "(requests enter the engine by API-key turns)")
    parser.add_argument("--max-request-tokens", type=int, default=defaults.max_request_tokens,
                        help="largest prompts x n x max_tokens one request may ask for")
    parser.add_argument("--max-scored-prompt-tokens", type=int, default=defaults.max_scored_prompt_tokens,
                        help="most prompt tokens one request may have scored (prompt_logprobs, echo with logprobs)")
    parser.add_argument("--max-structured-rows", type=int, default=defaults.max_structured_rows,
                        help="most sequences (prompts x n) of one request under a grammar")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="answer 413 to request bodies larger than this")
    parser.add_argument("--prefix-cache-isolation", choices=PREFIX_CACHE_ISOLATION,
                        default=defaults.prefix_cache_isolation,
                        help="'api-key': requests hit only prefix-cache blocks computed for the same API key")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="answer 503 to requests on new connections while this many connections that sent a "
                        "valid key (any request, without --api-key) are open")
    parser.add_argument("--max-pending-connections", type=int, default=defaults.max_pending_connections,
                        help="connections that have not yet sent a request with a valid key; past this many the "
                        "oldest idle one is closed")
    parser.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                        help="seconds a client has to send a request's headers")
    parser.add_argument("--body-timeout", type=float, default=defaults.body_timeout,
                        help="seconds a client has to send a request's body (408 after)")
    parser.add_argument("--send-timeout", type=float, default=defaults.send_timeout,
                        help="disconnect a client (aborting its request) that reads none of its output for this "
                        "many seconds")
    parser.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout,
                        help="after SIGTERM, seconds in-flight requests have to finish before their clients are "
                        "disconnected")
    _add_log_arguments(parser)
    _add_proxy_arguments(parser)
    _add_cors_arguments(parser)
    _add_process_arguments(parser)
    _add_answer_arguments(parser)


def _add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """What the server logs: its level, a line per request, the periodic stats line."""
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no log line per request (uvicorn's access log)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's prompts, token ids and sampling parameters")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="log no request's prompts (vLLM's older flag; this server's default already)")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="with --enable-log-requests: at most this many prompt characters and token ids a line")
    parser.add_argument("--uvicorn-log-level", default=None,
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default: --log-level's)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic log line of throughput, requests and KV-cache usage (every "
                             "$VLLM_LOG_STATS_INTERVAL seconds, 10)")


def _add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """How the server sits behind a proxy or gateway: the path it is served under, the ids it traces by."""
    parser.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="an X-Request-Id header on every answer: the request's own, else a new one")


def _add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    """Which web pages may call the server from a browser (CORS), vLLM's flags; by default none."""
    parser.add_argument("--allowed-origins", type=_json_strings, default=(), metavar="JSON",
                        help='origins whose pages may call the server, a JSON list, e.g. \'["https://app.example"]\' '
                             'or \'["*"]\' (default: none, where vLLM allows any)')
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    parser.add_argument("--allowed-methods", type=_json_strings, default=("*",), metavar="JSON",
                        help='CORS: the HTTP methods allowed, a JSON list (default: ["*"])')
    parser.add_argument("--allowed-headers", type=_json_strings, default=("*",), metavar="JSON",
                        help='CORS: the request headers allowed, a JSON list (default: ["*"])')


def _json_strings(text: str) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text}")
    return tuple(value)


def _add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """Which processes serve: the engine's own beside the HTTP server's, or a worker host's."""
    parser.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction,
                        default=multiprocessing_by_default(),
                        help="run the scheduler and the model in a process of their own, beside the HTTP server's "
                        f"(the default, unless ${MULTIPROCESSING_ENV} is 0); --no-engine-core-process runs all in "
                        "one process, for debugging")
    parser.add_argument("--api-server-count", type=int, default=1, metavar="N",
                        help="API server processes (HTTP, tokenization, streaming) on the one engine core, all "
                        "accepting on --port; each applies the connection limits on its own")
    parser.add_argument("--headless", action="store_true",
                        help="a worker host (--node-rank > 0): no HTTP server, only the driver's device calls")


def _add_answer_arguments(parser: argparse.ArgumentParser) -> None:
    """What the server serves and says beyond the base model's text: adapters, chat template, cached tokens,
    reasoning."""
    parser.add_argument("--lora-modules", nargs="+", type=_lora_module_arg, default=[], metavar="NAME=PATH",
                        help="LoRA adapters served under their own model names (name=path, or JSON with name and "
                             "path); needs --enable-lora")
    add_chat_template_argument(parser)
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="answers' usage also gives prompt_tokens_details.cached_tokens: the prompt tokens "
                             "found in the prefix cache")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="give a thinking model's <think> part as reasoning_content in chat answers")
    # vLLM needs these two for tool_choice "auto"; here it is always on, with one parser (server/tools.py).
    # Taken so that vLLM's command lines start; a parser this server does not have is refused.
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's switch for tool_choice 'auto', which is always on here")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="the format tool calls are read in: <tool_call> tags (Hermes', or SmolLM2's list in "
                             "one tag), vLLM's 'hermes', always")


def _lora_module_arg(text: str) -> tuple[str, str]:
    try:
        return parse_lora_module(text)
    except ValueError as error:  # argparse prints an ArgumentTypeError's message (a ValueError's it hides)
        raise argparse.ArgumentTypeError(str(error)) from None


def server_config(ns: argparse.Namespace, model_names: list[str]) -> ServerConfig:
    """ServerConfig from the flags: every field has the flag of its name (--chat-template's file is read)."""
    fields = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(ns, f.name)}
    if ns.enable_log_requests and ns.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other: give one")
    return ServerConfig(**{**fields, "model_name": model_names[0], "served_model_aliases": tuple(model_names[1:]),
                           "api_keys": tuple(ns.api_key),
                           "lora_modules": tuple(ns.lora_modules),
                           "chat_template": load_chat_template(ns.chat_template),
                           "log_stats_interval": log_stats_interval()})


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
