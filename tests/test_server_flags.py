"""vLLM's serve flags, on the tiny model served from a thread: --enable-log-requests with --max-log-len,
--root-path, --response-role, --ssl-keyfile and --ssl-certfile."""

import logging
import pathlib
import ssl

import httpx
import openai
import pytest

from jax_engine import EngineArgs, LLMEngine
from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.server.server_config import ServerConfig
from tests.server_helpers import TINY_ENGINE_ARGS, ThreadedServer


def tiny_engine(checkpoint) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(EngineArgs(**TINY_ENGINE_ARGS), checkpoint=checkpoint))


def test_requests_are_logged_when_asked_cut_to_max_log_len_and_quoted(tiny_checkpoint, caplog):
    """Each prompt's line names its request (the engine's id, which starts with the answer's), its prompt cut
    to max_log_len characters and quoted (a line break in a prompt cannot forge a log line), its first
    max_log_len token ids and its parameters. --root-path is the prefix the API's schema gives clients."""
    engine = tiny_engine(tiny_checkpoint)
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
    with ThreadedServer(tiny_engine(tiny_checkpoint), ServerConfig("tiny")) as server, caplog.at_level(logging.INFO):
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "secret", "max_tokens": 2}).status_code == 200
    assert not [r for r in caplog.records if "secret" in r.getMessage()]


def test_response_role_names_a_new_turns_answer(tiny_checkpoint):
    """--response-role for an answer that starts a turn, streamed or not; an answer that goes on the last message
    (add_generation_prompt false) has that message's role, as in vLLM."""
    hello = [{"role": "user", "content": "Hi"}]
    with ThreadedServer(tiny_engine(tiny_checkpoint), ServerConfig("tiny", response_role="model")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(model="tiny", messages=hello, max_tokens=2)
        first = next(iter(client.chat.completions.create(model="tiny", messages=hello, max_tokens=2, stream=True)))
        going_on = client.chat.completions.create(model="tiny", messages=hello, max_tokens=2,
                                                  extra_body={"add_generation_prompt": False})
    assert answer.choices[0].message.role == first.choices[0].delta.role == "model"
    assert going_on.choices[0].message.role == "user"


# A self-signed certificate for 127.0.0.1, valid to 2126, made once with: openssl req -x509 -newkey rsa:2048 -nodes
#   -keyout tls_key.pem -out tls_cert.pem -days 36500 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1
TLS = pathlib.Path(__file__).parent / "data"


def test_ssl_flags_serve_https(tiny_checkpoint):
    """--ssl-keyfile and --ssl-certfile: the API over HTTPS, checked against the certificate; plain HTTP gets
    no answer. A key without its certificate, or a missing file, is refused when the server is configured."""
    config = ServerConfig("tiny", ssl_keyfile=str(TLS / "tls_key.pem"), ssl_certfile=str(TLS / "tls_cert.pem"))
    trusting = ssl.create_default_context(cafile=config.ssl_certfile)
    # The client is closed before the server stops: asyncio waits up to 30 s for an open TLS connection's
    # goodbye (its ssl_shutdown_timeout), which an idle client never sends.
    with ThreadedServer(tiny_engine(tiny_checkpoint), config) as server, httpx.Client(verify=trusting) as http:
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, http_client=http)
        assert client.completions.create(model="tiny", prompt="ab", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)
    with pytest.raises(ValueError, match="ssl_keyfile and ssl_certfile go together"):
        ServerConfig("tiny", ssl_keyfile=str(TLS / "tls_key.pem"))
    with pytest.raises(ValueError, match="ssl_certfile must be a file"):
        ServerConfig("tiny", ssl_keyfile=str(TLS / "tls_key.pem"), ssl_certfile="/nowhere.pem")
