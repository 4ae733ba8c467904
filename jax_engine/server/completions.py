"""POST /v1/completions: OpenAI's (legacy) text completions, one or many prompts, streamed or not."""

import time
import uuid
from collections.abc import AsyncIterator

from jax_engine.server.errors import APIError
from jax_engine.server.protocol import CompletionRequest
from jax_engine.server.state import ServerState
from jax_engine.server.streams import (Delta, DeltaTracker, add_streams, collect, finite, merge, sse, sse_error,
                                       usage)


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of strings or token-id lists."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    return list(prompt)


def _logprobs(delta: Delta, offset: int) -> dict | None:
    """The legacy logprobs object: tokens, their logprobs, the top alternatives, and text offsets."""
    if delta.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(delta.token_ids, delta.logprobs):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(finite(chosen.logprob))
        top_logprobs.append({lp.decoded_token: finite(lp.logprob) for lp in entry.values()})
        text_offset.append(offset)
        offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


class Completions:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: CompletionRequest, cache_salt: str | None = None):
        """Validate, queue every prompt, then answer in one body or as server-sent events."""
        state = self.state
        params = state.sampling_params(body, body.max_tokens, body.logprobs)
        prompts = _prompts(body.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await add_streams(state, request_id, prompts, params, cache_salt)
        echoes = [await state.off_loop(lambda p=p: self._prompt_text(p)) if body.echo else "" for p in prompts]
        if body.stream:
            return self._events(request_id, body, streams, DeltaTracker.for_params(params), echoes)
        finals = await collect(streams)
        tracker = DeltaTracker.for_params(params)
        choices = sorted((self._choice(d, echoes[i]) for i, o in enumerate(finals) for d in tracker.deltas(i, o)),
                         key=lambda c: c["index"])
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": state.model_name, "choices": choices, "usage": usage(finals)}

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.state.tokenizer.decode(prompt)

    @staticmethod
    def _choice(delta: Delta, echo: str) -> dict:
        prefix = echo if delta.first else ""
        return {"index": delta.index, "text": prefix + delta.text, "logprobs": _logprobs(delta, len(prefix)),
                "finish_reason": delta.finish_reason}

    async def _events(self, request_id: str, body: CompletionRequest, streams, tracker: DeltaTracker,
                      echoes: list[str]) -> AsyncIterator[str]:
        created, finals = int(time.time()), {}
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.state.model_name}
        try:
            async for i, output in merge(streams):
                finals[i] = output
                for delta in tracker.deltas(i, output):
                    yield sse({**head, "choices": [self._choice(delta, echoes[i])]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage([finals[i] for i in range(len(streams))])})
        except Exception as error:  # the engine died mid-stream: say so in the stream, then end it
            yield sse_error(error)
        yield sse("[DONE]")
