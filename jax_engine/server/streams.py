"""Plumbing shared by the endpoints: queue a request's prompts, merge their streams, cut text deltas,
and stop work for clients that went away."""

import asyncio
import json
import logging
import math
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from jax_engine.async_llm_engine import (AsyncLLMEngine, EngineDeadError, GrammarFailedError, QueueFullError,
                                         RequestFailedError, RequestStream)
from jax_engine.beam_search import BeamSearchParams
from jax_engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from jax_engine.sampling_params import SamplingParams
from jax_engine.server.errors import APIError, bad_request, error_body, internal_error, queue_full
from jax_engine.server.state import ServerState

# A client that closed the connection before the answer (nginx's code; nobody reads it).
CLIENT_CLOSED_REQUEST = 499

logger = logging.getLogger(__name__)


def client_error(error: Exception) -> APIError:
    """What a client is told about an error: the status and a message, never the internals."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):  # SamplingParams' and the engine's checks name the field
        return bad_request(error)
    if isinstance(error, QueueFullError):
        return queue_full(str(error))
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), code="engine_dead")
    if isinstance(error, GrammarFailedError):  # the request's grammar passed its parser's limits mid-output
        return APIError(400, str(error), error.field, code="grammar_failed")
    if isinstance(error, RequestFailedError):  # the engine logged the traceback under the request id
        return APIError(500, f"request {error} failed inside the engine; the server log has the details",
                        code="request_failed")
    return internal_error("a request failed", error)


def refuse_if_busy(engine: AsyncLLMEngine, tenant: str | None = None) -> None:
    """Turn a request (of `tenant`) away at once, before its body is tokenized, when it would be refused anyway."""
    try:
        engine.check_accepting(tenant)
    except (QueueFullError, EngineDeadError) as error:
        raise client_error(error) from None


def token_id_name(token_id: int) -> str:
    """A token as logprobs show it under return_tokens_as_token_ids (vLLM's): for tokens that are no whole
    characters (a byte of one), which their text cannot tell apart."""
    return f"token_id:{token_id}"


def answer_id(prefix: str, header_id: str | None, body_id: str | None) -> str:
    """An answer's id, as vLLM's: the kind's prefix and the X-Request-Id header's id, else the body's request_id,
    else a random one."""
    return f"{prefix}-{header_id or body_id or uuid.uuid4().hex}"


async def add_streams(state: ServerState, request_id: str, prompts: list, params: SamplingParams | BeamSearchParams,
                      cache_salt: str | None = None, tenant: str | None = None,
                      model: str | None = None, field: str = "prompt", priority: int = 0) -> list[RequestStream]:
    """Queue one engine request per prompt, in `tenant`'s turn (its API key's; see fair_queue.py); all or none
    (a bad prompt, or a request that would cost more than the server allows one, queues none). `model` may name
    one of the server's LoRA adapters, which the prompts then run with; `field` is the request field the prompts
    came from, which errors about them name.

    The prompts are tokenized and checked on the server's tokenizer thread: a long prompt never holds up
    the event loop, and so never delays other clients or /health.
    """
    engine = state.engine
    limits = [n for n in (engine.max_waiting_requests, engine.max_waiting_per_tenant) if n is not None]
    if limits and len(prompts) > min(limits):  # could never be queued: the client's error, not overload
        raise APIError(400, f"{field}: at most {min(limits)} prompts per request, got {len(prompts)}", field)
    refuse_if_busy(engine, tenant)
    try:
        checked = await state.off_loop(lambda: [engine.engine.validate_request(p, params) for p in prompts])
    except ValueError as error:
        raise bad_request(error, field) from None
    state.check_cost(params, [len(c.prompt_token_ids) for c in checked])
    streams, unique = [], secrets.token_hex(4)  # clients may send one request_id twice at once: the engine's differ
    try:
        for i, (text, token_ids, engine_params) in enumerate(checked):
            prompt = {"prompt": text, "prompt_token_ids": token_ids, "cache_salt": cache_salt}
            streams.append(engine.add_request(f"{request_id}-{unique}-{i}", prompt, engine_params, tenant,
                                              state.lora_request(model), priority))
            if state.config.enable_log_requests:
                _log_request(streams[-1].request_id, text, token_ids, engine_params, model,
                             state.config.max_log_len)
    except Exception as error:
        for stream in streams:
            engine.abort(stream.request_id)
        raise client_error(error) from None
    return streams


def _log_request(request_id: str, text: str | None, token_ids: list[int], params, model: str | None,
                 max_len: int | None) -> None:
    """vLLM's line for --enable-log-requests: the prompt (quoted, so a line break in it cannot forge a line) and
    its ids, cut to max_len characters and ids."""
    logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, model: %s", request_id,
                None if text is None else text[:max_len], params, token_ids[:max_len], model)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they arrive; closing it aborts the unfinished ones.

    Outputs are cumulative (each holds all of its request's text and tokens so far), so while the reader is
    behind only each stream's newest output is kept: a client that reads slowly, or not at all, costs one
    output per prompt, never a backlog that grows with every step (vLLM's RequestOutputCollector does the same).
    """
    newest: dict[int, RequestOutput] = {}  # per prompt index, the newest output not yet yielded
    ended: dict[int, Exception | None] = {}  # per prompt index whose stream ended: its error, if any
    arrived = asyncio.Event()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                newest[index] = output  # replaces one the reader has not taken: this one holds it all
                arrived.set()
            ended[index] = None
        except Exception as error:
            ended[index] = error
        arrived.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            while newest:
                index = next(iter(newest))
                yield index, newest.pop(index)
            failed = [error for error in ended.values() if error is not None]
            if failed:
                raise failed[0]
            if len(ended) == len(tasks):
                return
            arrived.clear()  # no await since the checks above: nothing can have arrived unseen
            await arrived.wait()
    finally:
        for task in tasks:
            task.cancel()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """Every prompt's final output, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in merge(streams):
            finals[index] = output
    except Exception as error:
        raise client_error(error) from None
    return [finals[i] for i in range(len(streams))]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable) -> object:
    """Run a non-streaming handler's work, cancelling it (so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_error(error: Exception) -> str:
    """An error event in a stream that already answered 200."""
    reported = client_error(error)
    return sse(error_body(reported.status, reported.message, reported.param, reported.code))


def usage(finals: list[RequestOutput], prompt_tokens_details: bool = False) -> dict:
    """OpenAI's usage object; with `prompt_tokens_details` (vLLM's --enable-prompt-tokens-details) also how many
    prompt tokens were found in the prefix cache."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if prompt_tokens_details:
        counts["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in finals)}
    return counts


def prompt_logprobs(output: RequestOutput) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt position {token id: {logprob, rank, decoded_token}}, None first."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else {str(token): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                                     "decoded_token": lp.decoded_token} for token, lp in entry.items()}
            for entry in output.prompt_logprobs]


def finite(logprob: float) -> float:
    """JSON has no -inf: report impossible tokens as vLLM does, with a very negative number; nor NaN, which a row
    whose logits are not numbers has (an adapter of huge weights): reported the same way, not a 500."""
    return -9999.0 if math.isnan(logprob) else max(logprob, -9999.0)


@dataclass
class Delta:
    """What a completion added since the last event."""

    index: int  # choice index across prompts: prompt index * n + completion index
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it (vLLM's field)
    first: bool  # the first event of this choice


@dataclass
class DeltaTracker:
    """Turns successive RequestOutputs into text and token deltas per choice.

    While a completion runs, the last (longest stop string - 1) characters are held back: a stop string
    that completes later is cut from the text, and must not have been streamed already. Beam search sends
    nothing before its end (`final_only`, as vLLM's server): its beams reorder and rewrite their text.
    """

    n: int
    holdback: int
    final_only: bool = False
    _text_sent: dict[int, int] = field(default_factory=dict)
    _tokens_sent: dict[int, int] = field(default_factory=dict)
    _finished: set[int] = field(default_factory=set)

    @classmethod
    def for_params(cls, params: SamplingParams | BeamSearchParams) -> "DeltaTracker":
        if isinstance(params, BeamSearchParams):
            return cls(params.beam_width, 0, final_only=True)
        cut = params.stop and not params.include_stop_str_in_output
        return cls(params.n, max(map(len, params.stop)) - 1 if cut else 0)

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        if self.final_only and not output.finished:
            return []
        return [d for c in output.outputs if (d := self._delta(prompt_index * self.n + c.index, c)) is not None]

    def _delta(self, index: int, c: CompletionOutput) -> Delta | None:
        if index in self._finished:
            return None
        first = index not in self._text_sent
        text_start, token_start = self._text_sent.get(index, 0), self._tokens_sent.get(index, 0)
        text_end = len(c.text) if c.finish_reason else max(len(c.text) - self.holdback, text_start)
        if not first and text_end == text_start and len(c.token_ids) == token_start and not c.finish_reason:
            return None
        self._text_sent[index], self._tokens_sent[index] = text_end, len(c.token_ids)
        if c.finish_reason:
            self._finished.add(index)
        logprobs = c.logprobs[token_start:] if c.logprobs is not None else None
        return Delta(index, c.text[text_start:text_end], c.token_ids[token_start:], logprobs, c.finish_reason,
                     c.stop_reason if c.finish_reason else None, first)
