"""`jax-engine serve [MODEL]`: load the model and serve the OpenAI-compatible API with uvicorn.

SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish, then stops the engine loop.
"""

import argparse
import logging

from jax_engine.server.state import ServerConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a .gguf file or HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    parser.add_argument("--max-n", type=int, default=ServerConfig.max_n, help="largest n a request may ask for")
    parser.add_argument("--max-waiting-requests", type=int, default=ServerConfig.max_waiting_requests,
                        help="answer 503 to new requests while this many wait to start")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def main(ns: argparse.Namespace) -> None:
    import uvicorn

    from jax_engine.async_llm_engine import AsyncLLMEngine
    from jax_engine.cli import engine_args
    from jax_engine.config import EngineArgs
    from jax_engine.server.app import build_app

    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = EngineArgs(**{**engine_args(ns), "model": ns.model_tag or ns.model})
    name = ns.served_model_name or args.model or DEFAULT_MODEL_NAME
    config = ServerConfig(name, ns.api_key, ns.max_n, ns.max_waiting_requests)
    app = build_app(AsyncLLMEngine.from_engine_args(args), config)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
