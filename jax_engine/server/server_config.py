"""The server's own settings (the engine's are EngineArgs), apart from what serves with them: `jax-engine serve`
parses its flags with these before it imports the server, so that its engine core gets its arguments early."""

import argparse
import os
from dataclasses import dataclass

from jax_engine.chat_content import CONTENT_FORMATS, check_content_format
from jax_engine.server.reasoning import REASONING_PARSERS

PREFIX_CACHE_ISOLATION = ("none", "api-key")
# vLLM's names of the tool-call formats this server reads: server/tools.py's <tool_call> tags are Hermes'.
TOOL_CALL_PARSERS = ("hermes",)
LOG_STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"  # vLLM's variable, so an operator's setting carries over


@dataclass(frozen=True)
class ServerConfig:
    """The server's own settings (the engine's are EngineArgs); docs/serving.md#security explains the limits.

    Args:
        model_name: the name clients pass as `model` (and /v1/models lists), and answers give.
        served_model_aliases: other names clients may pass for the same model (--served-model-name's names after
            the first, as in vLLM; /v1/models lists them too, answers give model_name).
        api_keys: if any, every route but /health needs `Authorization: Bearer <one of them>`.
        max_n: the largest `n` (completions per prompt) a request may ask for.
        max_waiting_requests: past this many requests waiting to start, new ones get 503.
        max_body_bytes: larger request bodies get 413 before they are read.
        prefix_cache_isolation: "none", or "api-key": requests share prefix-cache blocks only with
            requests made with the same API key.
        max_connections: past this many open connections that sent a valid key (any request, without keys),
            requests on new connections get 503 (server/connections.py counts them).
        header_timeout: seconds a client has to send a request's headers before it is disconnected.
        max_pending_connections: connections that have not yet sent a request with a valid API key; past this
            many, the oldest idle one is closed to make room.
        body_timeout: seconds a client has to send a request's body (408 after).
        send_timeout: seconds a client may read none of its output before it is disconnected (its request
            aborted).
        shutdown_timeout: after SIGTERM, seconds in-flight requests have to finish before their clients are
            disconnected (and the requests aborted).
        max_waiting_per_key: past this many requests of one API key waiting to start, its new ones get 503
            (requests enter the engine by API-key turns: jax_engine/fair_queue.py).
        max_request_tokens: the most tokens one request may generate: prompts x n x max_tokens (max_tokens
            unset counts as what max_model_len leaves).
        max_scored_prompt_tokens: the most prompt tokens one request may have scored (prompt_logprobs, echo
            with logprobs).
        max_structured_rows: the most sequences (prompts x n) of one request that follow a grammar (each is a
            mask computed on the host every step).
        lora_modules: (name, path) of each LoRA adapter served under its own model name (needs enable_lora).
        enable_prompt_tokens_details: answers' usage also says how many prompt tokens the prefix cache held
            (prompt_tokens_details.cached_tokens), as vLLM's flag of that name.
        reasoning_parser: "deepseek_r1" or "qwen3": chat answers give a thinking model's <think> part as
            reasoning_content (server/reasoning.py); None: all of the text is content.
        chat_template: the chat template's text (--chat-template: a file, or the template itself), used instead
            of the model's own; None: the model's.
        chat_template_content_format: how messages' content reaches the template: "string", "openai" (a list
            of text parts) or "auto" (read from the template), as vLLM's flag (jax_engine/chat_content.py).
        allowed_origins: the web origins whose pages may call the server from a browser (CORS, vLLM's flag);
            "*" for any. Empty (the default, unlike vLLM's "*"): none, since a server on this machine would
            otherwise answer the scripts of every site its user visits.
        allow_credentials, allowed_methods, allowed_headers: the rest of the CORS answer, as vLLM's flags.
        disable_log_stats: no periodic line of throughput, requests and KV-cache usage in the log
            (server/stats_logger.py), as vLLM's flag.
        log_stats_interval: seconds between two such lines (`jax-engine serve` reads $VLLM_LOG_STATS_INTERVAL).
        disable_uvicorn_access_log: no log line per request, as vLLM's flag.
        enable_request_id_headers: an X-Request-Id header on every answer (server/request_id_header.py), as
            vLLM's flag.
        enable_log_requests: log each request's prompts, token ids and parameters (vLLM's flag; off, as in
            vLLM, so prompts stay out of the log); max_log_len: at most this many characters of a prompt and
            token ids of its ids in such a line (None: all).
        uvicorn_log_level: uvicorn's own log level (vLLM's flag); None: the server's --log-level.
        root_path: the path prefix a proxy serves the API under (vLLM's and uvicorn's --root-path).
        ssl_keyfile, ssl_certfile: serve HTTPS with this key and certificate (vLLM's and uvicorn's flags; both or
            neither); ssl_ca_certs, ssl_cert_reqs: the CA file to check client certificates with, and whether
            to ask for them (Python's ssl.CERT_NONE 0, CERT_OPTIONAL 1, CERT_REQUIRED 2).
        return_tokens_as_token_ids: logprobs show tokens as token_id:N unless a request says otherwise (vLLM's
            flag), for tokens that are no whole characters.
        response_role: the role of a chat answer that starts a new turn (vLLM's flag; one that goes on the last
            message, add_generation_prompt false, has that message's role).
    """

    model_name: str
    served_model_aliases: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    max_n: int = 16
    max_waiting_requests: int = 256
    max_body_bytes: int = 4 * 2**20
    prefix_cache_isolation: str = "none"
    max_connections: int = 1024
    header_timeout: float = 10.0
    max_pending_connections: int = 64
    body_timeout: float = 30.0
    send_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    max_waiting_per_key: int = 64
    max_request_tokens: int = 65_536
    max_scored_prompt_tokens: int = 16_384
    max_structured_rows: int = 64
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_prompt_tokens_details: bool = False
    reasoning_parser: str | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    allowed_origins: tuple[str, ...] = ()
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    disable_log_stats: bool = False
    log_stats_interval: float = 10.0
    disable_uvicorn_access_log: bool = False
    enable_request_id_headers: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None
    uvicorn_log_level: str | None = None
    root_path: str = ""
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0

    def __post_init__(self) -> None:
        if self.prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:
            raise ValueError(f"prefix_cache_isolation must be one of {PREFIX_CACHE_ISOLATION}, got "
                             f"{self.prefix_cache_isolation!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be None or one of {list(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        check_content_format(self.chat_template_content_format)
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both for HTTPS, or neither")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            if getattr(self, name) is not None and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{name} must be a file, got {getattr(self, name)!r}")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required), got {self.ssl_cert_reqs}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be None or >= 0, got {self.max_log_len}")
        if self.prefix_cache_isolation == "api-key" and not self.api_keys:
            raise ValueError("prefix_cache_isolation 'api-key' needs at least one API key")


def add_chat_template_argument(parser: argparse.ArgumentParser) -> None:
    """--chat-template and --chat-template-content-format, for serve and run-batch (jax_engine/chat_template.py,
    jax_engine/chat_content.py)."""
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the chat template to render chat requests with, instead of the model's own (a base "
                             "model may have none): a Jinja file, or the template itself")
    parser.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                        help="how messages' content reaches the chat template: 'string' (text parts joined with "
                             "newlines), 'openai' (a list of {type: text, text} parts) or 'auto' (whichever the "
                             "template reads)")


def log_stats_interval() -> float:
    """$VLLM_LOG_STATS_INTERVAL (default 10 s), read with the server's flags: a bad value stops the start."""
    text = os.environ.get(LOG_STATS_INTERVAL_ENV, "10")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{LOG_STATS_INTERVAL_ENV} must be a number of seconds > 0, got {text!r}")
    return value
