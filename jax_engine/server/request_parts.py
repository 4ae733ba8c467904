"""The parts a request body is made of (pydantic): structured-output formats, chat messages and tools.

The top-level bodies that hold them are in protocol.py.
"""

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from jax_engine.chat_content import template_content
from jax_engine.server.json_fields import Shallow, Text
from jax_engine.server.tools import TOOL_CALL_END, TOOL_CALL_START


class APIModel(BaseModel):
    # Strict: "5" is no integer and true is no token id. Unknown fields of the parts of a body are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(APIModel):
    include_usage: bool = False


class JsonSchemaFormat(APIModel):
    name: str = Field(max_length=64)
    description: str | None = None
    # pydantic's BaseModel owns the name `schema`
    json_schema: Annotated[dict | None, Shallow] = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(APIModel):
    """OpenAI's response_format: free text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(APIModel):
    """vLLM's `structured_outputs` request field (StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: Annotated[dict | str | bool | None, Shallow] = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class TextPart(APIModel):
    type: Literal["text"]
    text: Text


class FunctionCall(APIModel):
    name: str
    arguments: Annotated[str, Shallow]


class MessageToolCall(APIModel):
    """A tool call an earlier assistant message made (sent back by the client with the tool's answer)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(APIModel):
    # Any other role string would reach the chat template as is, where it could forge a turn.
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def template_content(self, content_format: str) -> str | list[dict]:
        """The content in the form the template reads (jax_engine/chat_content.py); an assistant's tool calls
        follow it, written as the model writes them."""
        texts = [part.text for part in self.content] if isinstance(self.content, list) else \
            [] if self.content is None else [self.content]
        calls = ""
        if self.tool_calls:
            calls = json.dumps([{"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}
                                for c in self.tool_calls])
            calls = f"{TOOL_CALL_START}{calls}{TOOL_CALL_END}"
        if content_format == "openai":
            return template_content(texts + [calls] if calls else texts, content_format)
        return template_content(texts, content_format) + calls


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def conversation(messages: list[ChatMessage], content_format: str) -> list[dict]:
    """Messages as the chat template takes them, their content in `content_format` ("string" or "openai")."""
    return [{"role": m.role, "content": m.template_content(content_format)} for m in messages]


class FunctionDefinition(APIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: Annotated[dict | None, Shallow] = None
    strict: bool | None = None


class Tool(APIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(APIModel):
    name: str


class NamedToolChoice(APIModel):
    type: Literal["function"]
    function: NamedFunction

