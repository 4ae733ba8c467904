"""The OpenAI-compatible HTTP server (vLLM's `vllm serve`): FastAPI routes over an AsyncLLMEngine.

    POST /v1/completions  /v1/chat/completions    OpenAI API, streamed as server-sent events on request
    POST /v1/embeddings                           OpenAI API, on a server started with --task embed
    GET  /v1/models  /health  /metrics             model list, liveness (503 once the engine died), Prometheus
    POST /tokenize  /detokenize  /generate         vLLM extras, and the simple demo endpoint
    POST /v1/load_lora_adapter  /v1/unload_lora_adapter    with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true only
"""

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.sampling_params import SamplingParams
from jax_engine.server.auth import APIKeyMiddleware
from jax_engine.server.chat import ChatCompletions, render_chat_prompt
from jax_engine.server.completions import Completions
from jax_engine.server.embeddings import Embeddings
from jax_engine.server.errors import APIError, bad_request, error_response, install_error_handlers
from jax_engine.server.limits import BodySizeLimitMiddleware, BodyTimeoutMiddleware
from jax_engine.server.metrics import ServingMetrics
from jax_engine.server.json_fields import check_json_fields
from jax_engine.server.lora_adapters import runtime_updates_allowed
from jax_engine.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from jax_engine.server.protocol_extras import (DetokenizeRequest, GenerateRequest, LoadLoRAAdapterRequest,
                                               TokenizeRequest, UnloadLoRAAdapterRequest)
from jax_engine.server.request_id_header import RequestIdHeaderMiddleware
from jax_engine.server.request_parts import conversation
from jax_engine.server.server_config import ServerConfig
from jax_engine.server.state import ServerState
from jax_engine.server.stats_logger import StatsLogger
from jax_engine.server.streams import add_streams, collect, merge, until_disconnect


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _respond(result):
    """A handler's dict becomes JSON; its async generator of events becomes a stream."""
    if isinstance(result, (dict, Response)):
        return result
    return StreamingResponse(result, media_type="text/event-stream")


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The server's ASGI app. The engine loop starts with the app and stops when it shuts down."""
    state = ServerState(engine, config)
    engine.max_waiting_requests = config.max_waiting_requests
    engine.max_waiting_per_tenant = config.max_waiting_per_key

    metrics = ServingMetrics(engine, config.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        stats = None if config.disable_log_stats else asyncio.create_task(
            StatsLogger(engine, metrics, config.log_stats_interval).run())
        yield
        if stats is not None:
            stats.cancel()
        await engine.stop()
        engine.engine.shutdown()  # release other hosts' workers now, not at exit

    # No /docs or /redoc: their pages load scripts from a CDN. The schema stays at /openapi.json.
    app = FastAPI(title="jax-engine OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(BodyTimeoutMiddleware, seconds=config.body_timeout)
    if config.api_keys:  # added late, so it runs early: nothing is read for a client without a key
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.allowed_origins:  # outermost: a browser's preflight carries no key, and a 401 needs the headers too
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_credentials=config.allow_credentials, allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers)
    if config.enable_request_id_headers:  # outermost: every answer carries it, a 401 or a CORS preflight too
        app.add_middleware(RequestIdHeaderMiddleware)
    _add_service_routes(app, state, metrics)
    _add_openai_routes(app, state)
    _add_vllm_routes(app, state)
    if runtime_updates_allowed():
        _add_lora_routes(app, state)
    return app


def _add_service_routes(app: FastAPI, state: ServerState, metrics: ServingMetrics) -> None:
    """/health, /version, /v1/models and /metrics: what load balancers, clients and Prometheus poll."""

    @app.get("/health")
    async def health():
        if state.engine.dead_error is not None:
            return error_response(503, "the engine loop died", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version():  # vLLM's: the serving package's version
        return {"version": metadata.version("paged-llm")}

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "jax-engine", "root": name,
                  "max_model_len": state.max_model_len} for name in state.model_names]
        return {"object": "list", "data": [*cards, *state.adapters.cards(created, state.max_model_len)]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    completions, chat, embeddings = Completions(state), ChatCompletions(state), Embeddings(state)

    def caller(raw_request: Request, salt: str | None) -> dict:
        """What a handler needs of the HTTP request beside its body: cache salt, tenant, X-Request-Id."""
        return {"cache_salt": state.cache_salt(raw_request, salt), "tenant": state.tenant(raw_request),
                "header_id": state.header_request_id(raw_request)}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request):
        work = completions.create(body, **caller(raw_request, body.cache_salt))
        return _respond(await until_disconnect(raw_request, work))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        work = chat.create(body, **caller(raw_request, body.cache_salt))
        return _respond(await until_disconnect(raw_request, work))

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw_request: Request):
        return await until_disconnect(raw_request, embeddings.create(body, **caller(raw_request, None)))


def _add_vllm_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's extras: /tokenize, /detokenize, and the demo endpoint /generate."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_fields(body)
        state.check_model(body.model)
        state.require_tokenizer("prompt", "tokenizing")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")

        def encode() -> list[int]:
            if body.messages is not None:
                # vLLM's chat tokenize request: the template's special tokens only (add_special_tokens=False)
                messages = conversation(body.messages, state.content_format)
                return render_chat_prompt(state, messages, body.add_generation_prompt,
                                          continue_final_message=body.continue_final_message)["prompt_token_ids"]
            state.check_text_fits(body.prompt, "prompt")
            return state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)

        tokens = await state.off_loop(encode)
        return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_fields(body)
        state.check_model(body.model)
        state.require_tokenizer("tokens", "detokenizing")
        state.check_token_ids(body.tokens, "tokens")
        return {"prompt": await state.off_loop(lambda: state.tokenizer.decode(body.tokens))}

    @app.post("/generate")
    async def generate(body: GenerateRequest, raw_request: Request):
        return await _demo_generate(state, body, raw_request)


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's run-time adapter updates (server/lora_adapters.py), answered as vLLM answers them."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        state.check_fields(body)
        try:
            request = state.adapters.new_request(body.lora_name, body.lora_path)
            await state.off_loop(lambda: state.adapters.check(request))
        except ValueError as error:
            raise bad_request(error) from None
        if body.lora_name in state.adapters.by_name:  # loaded by another request meanwhile
            raise APIError(400, f"the lora adapter {body.lora_name!r} has already been loaded", "lora_name")
        state.adapters.by_name[body.lora_name] = request
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        state.check_fields(body)
        if state.adapters.remove(body.lora_name) is None:
            raise APIError(404, f"the lora adapter {body.lora_name!r} cannot be found", "lora_name", "not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _demo_generate(state: ServerState, body: GenerateRequest, raw_request: Request):
    """vLLM's demo endpoint: {"prompt", "stream", **SamplingParams} -> {"text": [prompt + completion, ...]}."""
    fields = body.model_extra or {}
    unknown = sorted(set(fields) - SAMPLING_FIELDS)
    if unknown:
        raise APIError(400, f"unknown sampling parameters: {', '.join(unknown)[:200]}", unknown[0])
    try:
        check_json_fields(fields)  # the fields are plain JSON here, which SamplingParams does not expect
        params = SamplingParams(**fields)
    except ValueError as error:
        raise bad_request(error) from None
    state.check_n(params.n)
    streams = await add_streams(state, f"generate-{uuid.uuid4().hex}", [body.prompt], params,
                                state.cache_salt(raw_request, None), state.tenant(raw_request))

    def texts(output) -> dict:
        return {"text": [body.prompt + c.text for c in output.outputs]}

    async def lines():  # one JSON object per output, each ended by a NUL byte
        async for _, output in merge(streams):
            yield json.dumps(texts(output)).encode() + b"\0"

    async def answer():
        [final] = await collect(streams)
        return texts(final)

    if body.stream:
        return StreamingResponse(lines(), media_type="application/octet-stream")
    return await until_disconnect(raw_request, answer())
