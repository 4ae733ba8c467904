"""vLLM's serve flags for logs and proxies, on the tiny model served from a thread: --enable-log-requests with
--max-log-len, --root-path."""

import logging

import httpx

from jax_engine import EngineArgs, LLMEngine
from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.server.server_config import ServerConfig
from tests.server_helpers import TINY_ENGINE_ARGS, ThreadedServer


def test_requests_are_logged_when_asked_cut_to_max_log_len_and_quoted(tiny_checkpoint, caplog):
    """Each prompt's line names its request (the engine's id, which starts with the answer's), its prompt cut
    to max_log_len characters and quoted (a line break in a prompt cannot forge a log line), its first
    max_log_len token ids and its parameters. --root-path is the prefix the API's schema gives clients."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**TINY_ENGINE_ARGS), checkpoint=tiny_checkpoint))
    config = ServerConfig("tiny", enable_log_requests=True, max_log_len=6, root_path="/api")
    body = {"prompt": "ab\ncdefgh", "max_tokens": 2, "request_id": "logged"}
    with ThreadedServer(engine, config) as server, caplog.at_level(logging.INFO, "jax_engine.server.streams"):
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
        assert httpx.get(f"{server.url}/openapi.json").json()["servers"] == [{"url": "/api"}]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    ids = tiny_checkpoint.tokenizer.encode(body["prompt"])[:6]
    assert line.startswith("Received request cmpl-logged-") and "prompt: 'ab\\ncde', " in line, line
    assert f"prompt_token_ids: {ids}," in line and "max_tokens=2" in line and "\n" not in line


def test_requests_are_not_logged_by_default(tiny_checkpoint, caplog):
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**TINY_ENGINE_ARGS), checkpoint=tiny_checkpoint))
    with ThreadedServer(engine, ServerConfig("tiny")) as server, caplog.at_level(logging.INFO):
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "secret", "max_tokens": 2}).status_code == 200
    assert not [r for r in caplog.records if "secret" in r.getMessage()]
