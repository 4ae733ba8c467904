"""Tool calling on /v1/chat/completions: what the model is told, what it may write, what the client gets back.

    tools + tool_choice                          how it is enforced               what the client gets
    "none"                                       tools not shown, free text       message.content
    "auto"  (the default when tools are given)   the model chooses                content, and tool_calls parsed
                                                                                  from <tool_call>...</tool_call>
    "required"                                   a JSON-schema grammar: a list    tool_calls
                                                 of {"name", "arguments"}
    {"type": "function", "function": {name}}     a grammar: that function's       one tool_call of that function
                                                 parameters schema

The tools reach the model through its chat template when the template renders `tools`; otherwise (SmolLM2's
template does not) as a system message in the format SmolLM2 was trained on for function calling: a <tools>
list, and calls written as <tool_call>[{"name": ..., "arguments": {...}}]</tool_call>.
"""

import json
import uuid
from dataclasses import dataclass

from jax_engine.chat_content import template_content
from jax_engine.structured_output import StructuredOutputsParams

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

# What parsing a completion's text as calls can raise when it is not calls: not JSON, not objects with a name, or
# JSON the model nested deeper than json's recursion limit (output is the model's, so it can be anything).
NOT_CALLS = (ValueError, TypeError, KeyError, RecursionError)

# SmolLM2-Instruct's function-calling system prompt (from its model card), with the tools in place.
_TOOLS_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n{{\"name\": \"func_name1\", \"arguments\": {{\"argument1\": \"value1\", \"argument2\": "
    "\"value2\"}}}},\n... (more tool calls as required)\n]</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", self.id or f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def with_tools(messages: list[dict], tools: list[dict], template_renders_tools: bool,
               content_format: str) -> list[dict]:
    """The conversation the template sees: unchanged when the template renders `tools` itself, else with the
    tools described in the system message (appended to one the user wrote), in `content_format`
    (jax_engine/chat_content.py)."""
    if template_renders_tools:
        return messages
    prompt = template_content([_TOOLS_PROMPT.format(tools=json.dumps([t["function"] for t in tools]))],
                              content_format)
    if messages and messages[0]["role"] == "system":
        written = messages[0]["content"]
        content = written + prompt if content_format == "openai" else f"{written}\n\n{prompt}"
        return [{"role": "system", "content": content}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def tool_constraint(tools: list[dict], tool_choice: str | dict,
                    parallel: bool = True) -> StructuredOutputsParams | None:
    """The grammar that enforces tool_choice: a named function's parameters, or (required) a non-empty list
    of calls of the given functions, one call only unless `parallel` (parallel_tool_calls); None where the model
    chooses freely."""
    if isinstance(tool_choice, dict):
        return StructuredOutputsParams(json=_parameters(_named(tools, tool_choice)))
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": _parameters(t)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        one = {} if parallel else {"maxItems": 1}
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, **one, "items": {"anyOf": calls}})
    return None


def parse_tool_calls(text: str, tools: list[dict], tool_choice: str | dict) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished completion under tool_choice ("auto", "required" or named; under
    "none" the tools are not shown and nothing is parsed)."""
    if isinstance(tool_choice, dict):
        return None, [ToolCall(_named(tools, tool_choice)["function"]["name"], text)]
    if tool_choice == "required":
        return None, _calls(json.loads(text))
    return _parse_tagged(text)


def _parse_tagged(text: str) -> tuple[str | None, list[ToolCall]]:
    """Calls written as <tool_call>JSON</tool_call> (an object or a list of them); what is not a call, or does
    not parse as one, stays content."""
    content, calls, rest = [], [], text
    while (start := rest.find(TOOL_CALL_START)) >= 0 and (end := rest.find(TOOL_CALL_END, start)) >= 0:
        body = rest[start + len(TOOL_CALL_START): end]
        try:
            found = _calls(json.loads(body))
        except NOT_CALLS:
            found = None
        content.append(rest[:start] if found is not None else rest[: end + len(TOOL_CALL_END)])
        calls += found or []
        rest = rest[end + len(TOOL_CALL_END):]
    content = ("".join(content) + rest).strip()
    return content or None, calls


def _calls(value) -> list[ToolCall]:
    items = value if isinstance(value, list) else [value]
    return [ToolCall(str(item["name"]), json.dumps(item.get("arguments", item.get("parameters", {}))))
            for item in items]


def _named(tools: list[dict], tool_choice: dict) -> dict:
    name = tool_choice["function"]["name"]
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise ValueError(f"tool_choice names function {name!r}, which is not among tools "
                         f"({', '.join(t['function']['name'] for t in tools)})")
    return tool


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


class ToolCallStream:
    """One streamed choice under tool_choice: turns its text deltas into content and tool_call deltas.

    A named function's arguments stream as they come. Under "auto", text streams as content until a
    <tool_call> tag may be starting; from there it is held and parsed when the choice finishes. Under
    "required" the calls are sent when the choice finishes (the grammar makes them one JSON list). Without
    `parallel` (parallel_tool_calls false) only the first call is sent, as vLLM does.
    """

    def __init__(self, tools: list[dict], tool_choice: str | dict, parallel: bool = True) -> None:
        self.tools, self.tool_choice, self.parallel = tools, tool_choice, parallel
        self._held = ""  # text not yet sent
        self._named: ToolCall | None = None

    def delta(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send, tool_call deltas to send) for this much more text."""
        if isinstance(self.tool_choice, dict):
            return "", self._named_delta(text)
        self._held += text
        if not finished:
            if self.tool_choice == "required":
                return "", []
            cut = _safe_prefix(self._held)
            sent, self._held = self._held[:cut], self._held[cut:]
            return sent, []
        try:
            content, calls = parse_tool_calls(self._held, self.tools, self.tool_choice)
        except NOT_CALLS:  # a list cut short by max_tokens: the text as it is
            content, calls = self._held, []
        self._held = ""
        calls = calls if self.parallel else calls[:1]
        return content or "", [{"index": i, **call.as_dict()} for i, call in enumerate(calls)]

    def _named_delta(self, text: str) -> list[dict]:
        if not text:
            return []
        if self._named is None:
            self._named = ToolCall(_named(self.tools, self.tool_choice)["function"]["name"], "")
            return [{"index": 0, **ToolCall(self._named.name, text, self._named.id).as_dict()}]
        return [{"index": 0, "function": {"arguments": text}}]


def _safe_prefix(text: str) -> int:
    """How much of `text` can be sent as content: up to a <tool_call> tag, or to a suffix that may begin one."""
    start = text.find(TOOL_CALL_START)
    return start if start >= 0 else len(text) - partial_tag_length(text, TOOL_CALL_START)


def partial_tag_length(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the beginning of `tag` (held back while streaming)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0
