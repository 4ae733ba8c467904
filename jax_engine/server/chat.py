"""POST /v1/chat/completions: the model's chat template over the messages, then a completion."""

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from jax_engine.chat_template import chat_text, check_continuation, check_has_template, check_template_kwargs
from jax_engine.outputs import Logprob
from jax_engine.server.errors import APIError
from jax_engine.server.protocol import ChatCompletionRequest
from jax_engine.server.reasoning import ReasoningStream
from jax_engine.server.state import ServerState
from jax_engine.server.tools import ToolCallStream, with_tools
from jax_engine.server.streams import (Delta, DeltaTracker, add_streams, answer_id, collect, finite, merge,
                                       prompt_logprobs, refuse_if_busy, sse, sse_error, token_id_name, usage)


def _token_logprob(token_id: int, lp: Logprob, as_ids: bool) -> dict:
    token = token_id_name(token_id) if as_ids else lp.decoded_token or ""
    return {"token": token, "logprob": finite(lp.logprob), "bytes": list(token.encode())}


def _logprobs(delta: Delta, num_top: int, as_ids: bool) -> dict | None:
    """{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}, top alternatives by rank; `as_ids`:
    tokens shown as vLLM's token_id:N (return_tokens_as_token_ids)."""
    if delta.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(delta.token_ids, delta.logprobs):
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
                     key=lambda item: item[1].rank)
        content.append({**_token_logprob(token_id, entry[token_id], as_ids),
                        "top_logprobs": [_token_logprob(t, lp, as_ids) for t, lp in top]})
    return {"content": content}


def render_chat_prompt(state: ServerState, messages: list[dict], add_generation_prompt: bool,
                       add_special_tokens: bool = False, tools: list[dict] | None = None,
                       template_kwargs: dict | None = None, continue_final_message: bool = False) -> dict:
    """The conversation through the chat template (--chat-template's, else the model's), tokenized once (as
    chat_template.chat_prompt), with the tools shown to the model (server/tools.py); a template error is the
    client's (400)."""
    template = state.config.chat_template
    renders_tools = "tools" in (template or state.tokenizer.chat_template or "")
    if tools:
        messages = with_tools(messages, tools, renders_tools, state.content_format)
    _checked("chat_template_kwargs", check_template_kwargs, template_kwargs)
    _checked("continue_final_message", check_continuation, add_generation_prompt, continue_final_message)
    _checked("messages", check_has_template, state.tokenizer, template)
    try:
        text = chat_text(state.tokenizer, messages, add_generation_prompt, tools if tools and renders_tools else None,
                         template_kwargs, chat_template=template, continue_final_message=continue_final_message)
    except Exception as error:  # jinja's TemplateError, or the template's own raise_exception
        raise APIError(400, f"messages could not be rendered with the chat template: {error}", "messages") from None
    state.check_text_fits(text, "messages")
    return {"prompt": text, "prompt_token_ids": state.tokenizer.encode(text, add_special_tokens=add_special_tokens)}


def _checked(field: str, check, *args) -> None:
    """`check(*args)`, its ValueError a 400 naming `field`."""
    try:
        check(*args)
    except ValueError as error:
        raise APIError(400, str(error), field) from None


@dataclass
class ChoiceText:
    """One choice's text, delta by delta: its reasoning split off (--reasoning-parser), then its tool calls
    parsed out of the rest (when tools were shown)."""

    reasoning: ReasoningStream | None
    tools: ToolCallStream | None

    def delta(self, text: str, finished: bool) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool_call deltas) to send for this much more text."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.delta(text, finished)
        if self.tools is None:
            return reasoning, text, []
        return reasoning, *self.tools.delta(text, finished)


def _message(d: Delta, choice: ChoiceText, tool_choice: str | dict, role: str) -> dict:
    """A finished choice's message and finish_reason: its reasoning, content and tool calls."""
    reasoning, content, calls = choice.delta(d.text, finished=True)
    message = {"role": role, "content": content if choice.tools is None else content or None}
    if choice.reasoning is not None:
        message["reasoning_content"] = reasoning or None
    if choice.tools is not None:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
    return {"message": message, "finish_reason": finish_reason(d.finish_reason, calls, tool_choice),
            "stop_reason": d.stop_reason}


def finish_reason(reason: str | None, calls: list, tool_choice: str | dict) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call, "stop" when the call was forced by name."""
    return "tool_calls" if calls and not isinstance(tool_choice, dict) and reason == "stop" else reason


class ChatCompletions:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: ChatCompletionRequest, cache_salt: str | None = None, tenant: str | None = None,
                     header_id: str | None = None):
        state = self.state
        state.require_tokenizer("messages", "the chat template")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        num_top = body.top_logprobs or 0
        params = await state.sampling_params(body, body.max_completion_tokens or body.max_tokens,
                                             num_top if body.logprobs else None)
        refuse_if_busy(state.engine, tenant)
        tools, tool_choice = body.tool_list, body.effective_tool_choice
        shown_tools = tools if tool_choice != "none" else None
        prompt = await state.off_loop(lambda: render_chat_prompt(state, body.conversation(state.content_format),
                                                                 body.add_generation_prompt,
                                                                 body.add_special_tokens, shown_tools,
                                                                 body.chat_template_kwargs,
                                                                 body.continue_final_message))
        request_id = answer_id("chatcmpl", header_id, body.request_id)
        streams = await add_streams(state, request_id, [prompt], params, cache_salt, tenant, body.model, "messages",
                                    body.priority)
        if body.stream:
            return self._events(request_id, body, streams, DeltaTracker.for_params(params), num_top)
        [final] = await collect(streams)
        choices = [{"index": d.index, **_message(d, self._choice_text(body), tool_choice, self._role(body)),
                    "logprobs": _logprobs(d, num_top, state.tokens_as_ids(body))}
                   for d in DeltaTracker.for_params(params).deltas(0, final)]
        answer = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                  "model": state.served_name(body.model), "choices": choices,
                  "usage": usage([final], state.config.enable_prompt_tokens_details)}
        return answer if final.prompt_logprobs is None else {**answer, "prompt_logprobs": prompt_logprobs(final)}

    def _role(self, body: ChatCompletionRequest) -> str:
        """The answer's role, as vLLM's: --response-role's for a new turn, else that of the message it goes on."""
        return self.state.config.response_role if body.add_generation_prompt else body.messages[-1].role

    def _choice_text(self, body: ChatCompletionRequest) -> ChoiceText:
        parser, tool_choice = self.state.config.reasoning_parser, body.effective_tool_choice
        tools = ToolCallStream(body.tool_list, tool_choice, body.parallel_tool_calls) if (
            body.tools and tool_choice != "none") else None
        return ChoiceText(None if parser is None else ReasoningStream(parser), tools)

    async def _events(self, request_id: str, body: ChatCompletionRequest, streams, tracker: DeltaTracker,
                      num_top: int) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.state.served_name(body.model)}
        final, role, as_ids = None, self._role(body), self.state.tokens_as_ids(body)
        choices = {}  # choice index -> its ChoiceText
        try:
            async for _, final in merge(streams):
                for d in tracker.deltas(0, final):
                    if d.first:  # OpenAI opens each choice with the role alone
                        yield sse({**head, "choices": [{"index": d.index, "delta": {"role": role, "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
                    choice = choices.setdefault(d.index, self._choice_text(body))
                    reasoning, content, calls = choice.delta(d.text, finished=d.finish_reason is not None)
                    delta = {"reasoning_content": reasoning} if reasoning else {}
                    delta |= {"content": content} if content else {}
                    delta |= {"tool_calls": calls} if calls else {}
                    reason = finish_reason(d.finish_reason, calls, body.effective_tool_choice)
                    # Text held back (a tag that may be beginning): nothing to send yet, as vLLM sends nothing.
                    if not delta and reason is None and d.logprobs is None:
                        continue
                    yield sse({**head, "choices": [{"index": d.index, "delta": delta,
                                                    "logprobs": _logprobs(d, num_top, as_ids),
                                                    "finish_reason": reason, "stop_reason": d.stop_reason}]})
            if body.include_usage:
                yield sse({**head, "choices": [],
                           "usage": usage([final], self.state.config.enable_prompt_tokens_details)})
        except Exception as error:
            yield sse_error(error)
        yield sse("[DONE]")
