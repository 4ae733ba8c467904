"""`jax-engine run-batch -i requests.jsonl -o results.jsonl [MODEL]`: vLLM's run-batch, OpenAI's batch file format
run offline through the server's own handlers, no HTTP.

Each input line is {"custom_id", "method": "POST", "url", "body"}, the url "/v1/chat/completions",
"/v1/completions" or (with --task embed) "/v1/embeddings"; each output line, in the input's order, {"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}. A line that fails (a bad body, a bad
value, an unsupported url) gets its status code and OpenAI's error object and the others run on, as vLLM does.
The requests are queued together, so continuous batching runs them as it runs a server's.
"""

import argparse
import asyncio
import json
import logging
import uuid

from pydantic import ValidationError
from tqdm import tqdm

from jax_engine.chat_template import load_chat_template
from jax_engine.server.chat import ChatCompletions
from jax_engine.server.completions import Completions
from jax_engine.server.embeddings import Embeddings
from jax_engine.server.errors import APIError, error_body, validation_message
from jax_engine.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from jax_engine.server.server_config import ServerConfig, add_chat_template_argument
from jax_engine.server.state import ServerState
from jax_engine.server.streams import client_error

ENDPOINTS = {"/v1/chat/completions": (ChatCompletionRequest, ChatCompletions),
             "/v1/completions": (CompletionRequest, Completions),
             "/v1/embeddings": (EmbeddingRequest, Embeddings)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a .gguf file or HF checkpoint directory (default: the default model)")
    parser.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line")
    parser.add_argument("-o", "--output-file", required=True, help="where the results are written, a line each")
    parser.add_argument("--served-model-name", default=None, help="the model name bodies may give")
    add_chat_template_argument(parser)


class BatchRunner:
    """Runs batch lines through the chat and completions handlers of a ServerState."""

    def __init__(self, state: ServerState) -> None:
        self.handlers = {url: (body_type, handler(state)) for url, (body_type, handler) in ENDPOINTS.items()}
        # Never more requests waiting than the engine queues: the rest wait here, none is turned away.
        self.slots = asyncio.Semaphore(state.config.max_waiting_requests)

    async def run_line(self, line: str) -> dict:
        request_id = f"vllm-batch-{uuid.uuid4().hex}"
        custom_id = None
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise APIError(400, "each line must be a JSON object with custom_id, method, url and body")
            custom_id = request.get("custom_id")
            body = await self._answer(request)
            response, error = {"status_code": 200, "request_id": request_id, "body": body}, None
        except Exception as failure:  # noqa: BLE001 - each line's failure is its own, reported in its line
            reported = _reported(failure)
            error = error_body(reported.status, reported.message, reported.param, reported.code)["error"]
            response = {"status_code": reported.status, "request_id": request_id, "body": None}
        return {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}

    async def _answer(self, request: dict) -> dict:
        url, method = request.get("url"), request.get("method", "POST")
        if method != "POST" or url not in self.handlers:
            raise APIError(400, f"url: {method} {url} is not supported; supported: POST {', '.join(self.handlers)}",
                           "url")
        body_type, handler = self.handlers[url]
        body = body_type.model_validate_json(json.dumps(request.get("body")))  # as the server reads a body
        if getattr(body, "stream", False):  # embeddings have no stream field
            raise APIError(400, "stream: a batch line's answer is written whole; leave stream false", "stream")
        async with self.slots:
            return await handler.create(body)


def _reported(failure: Exception) -> APIError:
    if isinstance(failure, json.JSONDecodeError):
        return APIError(400, f"the line is not valid JSON: {failure}")
    if isinstance(failure, ValidationError):
        return APIError(400, *validation_message(failure))
    return client_error(failure)


async def run_batch(engine, config: ServerConfig, lines: list[str]) -> list[dict]:
    """Every line's result, in order, with a progress bar."""
    runner = BatchRunner(ServerState(engine, config))
    engine.start()
    try:
        bar = tqdm(total=len(lines), desc="Running batch", unit="req")

        async def counted(line: str) -> dict:
            result = await runner.run_line(line)
            bar.update(1)
            return result

        results = await asyncio.gather(*(counted(line) for line in lines))
        bar.close()
        return results
    finally:
        await engine.stop()


def main(ns: argparse.Namespace) -> None:
    from jax_engine.async_llm_engine import AsyncLLMEngine
    from jax_engine.config import EngineArgs
    from jax_engine.server.serve import DEFAULT_MODEL_NAME

    logging.basicConfig(level="WARNING", format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    with open(ns.input_file) as f:
        lines = [line for line in f if line.strip()]
    args = EngineArgs.from_cli_args(ns, model=ns.model_tag or ns.model)
    config = ServerConfig(ns.served_model_name or args.model or DEFAULT_MODEL_NAME,
                          chat_template=load_chat_template(ns.chat_template),
                          chat_template_content_format=ns.chat_template_content_format)
    results = asyncio.run(run_batch(AsyncLLMEngine.from_engine_args(args), config, lines))
    with open(ns.output_file, "w") as f:
        for result in results:
            f.write(json.dumps(result) + "\n")
    failed = sum(result["error"] is not None for result in results)
    print(f"{len(results)} requests, {failed} failed: {ns.output_file}")
