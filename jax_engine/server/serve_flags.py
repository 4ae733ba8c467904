"""`jax-engine serve`'s flags, as vLLM names them, and the ServerConfig they make (the engine's own flags come
from EngineArgs.add_cli_args)."""

import argparse
import dataclasses
import json

from jax_engine.chat_template import load_chat_template
from jax_engine.engine_core.launch import MULTIPROCESSING_ENV, multiprocessing_by_default
from jax_engine.server.lora_adapters import parse_lora_module
from jax_engine.server.reasoning import REASONING_PARSERS
from jax_engine.server.server_config import (PREFIX_CACHE_ISOLATION, TOOL_CALL_PARSERS, ServerConfig,
                                             add_chat_template_argument, log_stats_interval)


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
    _add_network_arguments(parser)
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


def _add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """How clients reach the server: over TLS or not, under a proxy's path, traced by which ids."""
    parser.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    parser.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--ssl-ca-certs", default=None, help="the CA certificates to check client certificates with")
    parser.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*)")
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
    parser.add_argument("--response-role", default="assistant",
                        help="the role of chat answers that start a new turn")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs show tokens as token_id:N (a request's return_tokens_as_token_ids also does)")
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
