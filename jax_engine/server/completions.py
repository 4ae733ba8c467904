"""POST /v1/completions: OpenAI's (legacy) text completions, one or many prompts, streamed or not."""

import time
from collections.abc import AsyncIterator

from jax_engine.outputs import RequestOutput
from jax_engine.server.errors import APIError
from jax_engine.server.protocol import CompletionRequest
from jax_engine.server.state import ServerState
from jax_engine.server.streams import (Delta, DeltaTracker, add_streams, answer_id, collect, finite, merge,
                                       prompt_logprobs, sse, sse_error, token_id_name, usage)


def prompt_list(prompt: str | list, field: str = "prompt") -> list[str | list[int]]:
    """OpenAI's four prompt shapes (of a completion's prompt, an embedding's input) -> a list of strings or
    token-id lists."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, f"{field} must not be empty", field)
    return list(prompt)


def _logprobs(token_ids: list[int], entries: list | None, offset: int, name) -> dict | None:
    """The legacy logprobs object: tokens, their logprobs, the top alternatives, and text offsets. A prompt's
    first token has no entry (None): nothing precedes it. `name(token id, its Logprob or None)` is how a token
    is shown."""
    if entries is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = name(token_id, entry[token_id] if entry else None)
        tokens.append(text)
        token_logprobs.append(finite(entry[token_id].logprob) if entry else None)
        top_logprobs.append({name(t, lp): finite(lp.logprob) for t, lp in entry.items()} if entry else None)
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _joined(first: dict | None, second: dict | None) -> dict | None:
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


class Completions:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: CompletionRequest, cache_salt: str | None = None, tenant: str | None = None,
                     header_id: str | None = None):
        """Validate, queue every prompt, then answer in one body or as server-sent events.

        echo puts the prompt before the text, and with logprobs its tokens' logprobs before the text's (the way
        lm-eval scores answers); max_tokens=0 with echo scores the prompt alone: one token is generated, as
        vLLM does, and left out.
        """
        state = self.state
        scoring_only = body.max_tokens == 0
        if scoring_only and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 unless echo is true (which then returns the prompt alone)",
                           "max_tokens")
        for field, asked in (("echo", body.echo), ("logprobs", body.logprobs is not None)):
            if asked:
                state.require_tokenizer(field, "the text of tokens")
        if body.echo and body.logprobs is not None:
            body = body.model_copy(update={"prompt_logprobs": body.logprobs})
        params = await state.sampling_params(body, 1 if scoring_only else body.max_tokens, body.logprobs)
        prompts = prompt_list(body.prompt)
        request_id = answer_id("cmpl", header_id, body.request_id)
        streams = await add_streams(state, request_id, prompts, params, cache_salt, tenant, body.model,
                                    priority=body.priority)
        echoes = [await state.off_loop(lambda p=p: self._prompt_text(p)) if body.echo else "" for p in prompts]
        if body.stream and not scoring_only:
            return self._events(request_id, body, streams, DeltaTracker.for_params(params), echoes)
        finals = await collect(streams)
        tracker = DeltaTracker.for_params(params)
        choices = sorted((self._choice(d, echoes[i], o, body, scoring_only)
                          for i, o in enumerate(finals)
                          for d in tracker.deltas(i, o)), key=lambda c: c["index"])
        counts = usage(finals, state.config.enable_prompt_tokens_details)
        if scoring_only:
            counts = {**counts, "completion_tokens": 0, "total_tokens": counts["prompt_tokens"]}
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": state.served_name(body.model)}
        if body.stream:  # scoring only: the whole answer in one event per choice
            return self._single_events(head, choices, counts if body.include_usage else None)
        return {**head, "choices": choices, "usage": counts}

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self._decode(prompt)

    def _decode(self, token_ids: list[int]) -> str:
        """Text of tokens: only for echo and logprobs, which a server without a tokenizer refuses."""
        return self.state.tokenizer.decode(token_ids)

    def _token_name(self, body: CompletionRequest):
        """How logprobs show a token: its text, or vLLM's token_id:N (return_tokens_as_token_ids)."""
        if self.state.tokens_as_ids(body):
            return lambda token_id, _: token_id_name(token_id)
        return lambda token_id, lp: lp.decoded_token if lp is not None else self._decode([token_id])

    def _choice(self, delta: Delta, echo: str, output: RequestOutput, body: CompletionRequest,
                scoring_only: bool = False) -> dict:
        prefix, name = echo if delta.first else "", self._token_name(body)
        prompt = None
        if prefix and output is not None and output.prompt_logprobs is not None:
            prompt = _logprobs(output.prompt_token_ids, output.prompt_logprobs, 0, name)
        if scoring_only:
            return {"index": delta.index, "text": prefix, "logprobs": prompt, "finish_reason": "length",
                    "stop_reason": None, "prompt_logprobs": prompt_logprobs(output)}
        generated = _logprobs(delta.token_ids, delta.logprobs, len(prefix), name)
        choice = {"index": delta.index, "text": prefix + delta.text, "logprobs": _joined(prompt, generated),
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        if delta.first and output is not None and output.prompt_logprobs is not None:  # vLLM's field, as well
            choice["prompt_logprobs"] = prompt_logprobs(output)
        if body.return_token_ids:  # vLLM's: the prompt's ids with a choice's first event, then each event's new ones
            choice |= {"prompt_token_ids": output.prompt_token_ids if delta.first else None,
                       "token_ids": delta.token_ids}
        return choice

    @staticmethod
    async def _single_events(head: dict, choices: list[dict], counts: dict | None) -> AsyncIterator[str]:
        for choice in choices:
            yield sse({**head, "choices": [choice]})
        if counts is not None:
            yield sse({**head, "choices": [], "usage": counts})
        yield sse("[DONE]")

    async def _events(self, request_id: str, body: CompletionRequest, streams, tracker: DeltaTracker,
                      echoes: list[str]) -> AsyncIterator[str]:
        created, finals = int(time.time()), {}
        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.state.served_name(body.model)}
        try:
            async for i, output in merge(streams):
                finals[i] = output
                for delta in tracker.deltas(i, output):
                    choice = self._choice(delta, echoes[i], output, body)
                    yield sse({**head, "choices": [choice]})
            if body.include_usage:
                finished = [finals[i] for i in range(len(streams))]
                yield sse({**head, "choices": [],
                           "usage": usage(finished, self.state.config.enable_prompt_tokens_details)})
        except Exception as error:  # the engine died mid-stream: say so in the stream, then end it
            yield sse_error(error)
        yield sse("[DONE]")
