"""Request bodies of the OpenAI-compatible API (pydantic), with OpenAI's and vLLM's field names.

Limits that need no model live here, so the OpenAPI schema documents them and a bad value is a 400 before
anything reaches the engine. Limits that depend on the model (prompt length, token ids) are the engine's.
The parts of a body (messages, tools, formats) are in request_parts.py, the checks on its JSON values in
json_fields.py.
"""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from jax_engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from jax_engine.input_checks import check
from jax_engine.pooling_params import PoolingParams
from jax_engine.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams
from jax_engine.server.json_fields import Shallow, Text
from jax_engine.server.request_parts import (APIModel, ChatMessage, NamedToolChoice, ResponseFormat, StreamOptions,
                                             StructuredOutputsBody, Tool, conversation)
from jax_engine.server.tools import tool_constraint
from jax_engine.structured_output import StructuredOutputsParams

Finite = Annotated[float, Field(allow_inf_nan=False)]
Priority = Annotated[int, Field(ge=-(2**63), lt=2**63, description="vLLM's: with --scheduling-policy priority, lower "
                                "runs first; else 0")]
# vLLM's request_id (a body field, or the X-Request-Id header): the answer's id is its kind's prefix and this.
# Visible ASCII only, as it is logged: no line breaks to forge log lines with.
REQUEST_ID_PATTERN = "^[!-~]{1,256}$"
RequestId = Annotated[str | None, Field(pattern=REQUEST_ID_PATTERN, description="vLLM's: the answer's id is cmpl- "
                                        "(chatcmpl-, embd-) and this; default: a random one. 1-256 visible ASCII "
                                        "characters")]


# Fields of OpenAI's request schemas that change nothing this server could honour or a client could see:
# accepted, with a warning logged once per field name, as vLLM accepts them. Any other field this server does
# not implement is refused with a 400 that names it (ServerState.check_fields), never silently dropped.
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_options",
                            "prompt_cache_retention", "safety_identifier", "moderation"})


class RequestBody(APIModel):
    """A request's top-level body: unknown fields are kept (model_extra) to be refused or warned about."""

    model_config = ConfigDict(extra="allow", strict=True)


# The sampling fields a model's generation config may set, and the value when neither it nor the request does:
# SamplingParams' own default.
_DEFAULTS = {name: getattr(SamplingParams(), name) for name in
             ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}

# vLLM's older spelling of structured_outputs: one top-level field per kind.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
CONTINUE_FINAL_MESSAGE = ("vLLM's: the model goes on writing the last message (no end of turn after it); needs "
                          "add_generation_prompt false")
# What beam search reads of a request besides its prompt and the answer's form (vLLM's to_beam_search_params):
# any other field sent with a value other than its default is a 400 naming it, since beam search would not
# honour it (vLLM drops them silently).
BEAM_SEARCH_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "n", "temperature", "ignore_eos", "use_beam_search",
    "length_penalty", "stream", "stream_options", "user", "cache_salt", "request_id", "priority",
    "prompt", "echo", "return_token_ids",  # completions
    "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template_kwargs",
})
# Values of sampling fields that change nothing, which clients often send: accepted beside use_beam_search.
_NEUTRAL = {"top_p": (1,), "top_k": (0, -1), "min_p": (0,), "repetition_penalty": (1,)}
# Names vLLM takes for its grammar backends; this server has one (llguidance) and accepts the names that mean it.
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")


class SamplingRequest(RequestBody):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Finite | None = Field(None, ge=0, description="default 1; 0 is greedy")
    top_p: Finite | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM extension; 0 or -1 disable")
    min_p: Finite | None = Field(None, ge=0, le=1, description="default 0")
    n: int = Field(1, ge=1)
    stop: Text | list[Text] | None = Field(None, description=f"at most {MAX_STOP_STRINGS} strings")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: Finite = Field(0.0, ge=-2, le=2)
    frequency_penalty: Finite = Field(0.0, ge=-2, le=2)
    repetition_penalty: Finite | None = Field(None, gt=0, description="default 1")
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: Text | None = Field(None, min_length=1, description="vLLM's: prefix-cache hits only between "
                                    "requests with the same salt")
    request_id: RequestId = None
    priority: Priority = 0
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM's: logprobs show tokens as "
                                                    "token_id:N; default: --return-tokens-as-token-ids")
    logit_bias: dict[str, Finite] | None = Field(None, description="token id (a string, as OpenAI's) -> bias "
                                                  "in [-100, 100]")
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    bad_words: list[Text] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the prompt's last k tokens")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's: logprobs of every "
                                        "prompt token")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = Field(None, description="vLLM's: json, regex, choice, "
                                                             "grammar or json_object")
    guided_json: Annotated[dict | str | None, Shallow] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal[GRAMMAR_BACKENDS] | None = None
    use_beam_search: bool = Field(False, description="vLLM's: the n most likely answers by beam search, best "
                                  "first (temperature 0 or unset; sampling fields are refused)")
    length_penalty: Finite = Field(1.0, ge=-10, le=10, description="vLLM's, for beam search: a beam scores its "
                                   "log-probability sum over its length ** length_penalty")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """SamplingParams for this request (SamplingParams checks what pydantic cannot, e.g. min_tokens).

        `defaults` (the model's generation config, LLMEngine.default_sampling_fields) fill the sampling fields
        the request leaves out, and cap max_tokens, as in vLLM's server.
        """
        defaults = defaults or {}
        check(self.length_penalty == 1.0, "length_penalty", "1 (its default) unless use_beam_search is true: only "
              "beam search ranks by length", self.length_penalty)
        return SamplingParams(
            n=self.n, **{name: self._or_default(name, defaults) for name in _DEFAULTS},
            seed=self.seed, max_tokens=_capped(max_tokens, defaults), stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or (),
            truncate_prompt_tokens=self.truncate_prompt_tokens, prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.structured_output_params())

    def beam_search_params(self, max_tokens: int | None, defaults: dict | None = None) -> BeamSearchParams:
        """BeamSearchParams for use_beam_search (vLLM's to_beam_search_params): n beams. A ValueError names the
        first field sent that beam search would not honour (a sampling field, logprobs, stop strings, a grammar);
        the model's generation config caps max_tokens but sets no temperature: beams rank by log-probability."""
        for name in sorted(self.model_fields_set - BEAM_SEARCH_FIELDS):
            value = getattr(self, name)
            check(value == type(self).model_fields[name].default or value in _NEUTRAL.get(name, ()), name,
                  "left out with use_beam_search (beam search does not use it)", value)
        check(self.n <= MAX_BEAM_WIDTH, "n", f"at most {MAX_BEAM_WIDTH} beams with use_beam_search", self.n)
        return BeamSearchParams(beam_width=self.n, max_tokens=_capped(max_tokens, defaults or {}),
                                ignore_eos=self.ignore_eos, temperature=self.temperature or 0,
                                length_penalty=self.length_penalty)

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The one constraint among response_format, structured_outputs and guided_*; ValueError naming the
        fields when several are set."""
        given = self._structured_outputs()
        if len(given) > 1:
            raise ValueError(f"only one structured-output constraint may be set, got {', '.join(given)}")
        return next(iter(given.values()), None)

    @property
    def structured_output_field(self) -> str | None:
        """The request field the constraint came from, as errors about it name it."""
        name = next(iter(self._structured_outputs()), None)
        return "response_format.json_schema.schema" if name == "response_format" else name

    def _structured_outputs(self) -> dict[str, StructuredOutputsParams]:
        given = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self._response_format_params()
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
            given["structured_outputs"] = StructuredOutputsParams(**fields)
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                given[name] = StructuredOutputsParams(**{kind: getattr(self, name)})
        return given

    def _response_format_params(self) -> StructuredOutputsParams:
        if self.response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = self.response_format.json_schema
        if schema is None or schema.json_schema is None:
            raise ValueError("response_format.json_schema.schema is required for type json_schema")
        return StructuredOutputsParams(json=schema.json_schema)

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI keys logit_bias by token ids written as strings."""
        if self.logit_bias is None:
            return None
        bad = [key for key in self.logit_bias if not key.isdigit()]
        if bad:
            raise ValueError(f"logit_bias must be keyed by token ids (strings of digits), got {bad[0]!r}")
        return {int(key): value for key, value in self.logit_bias.items()}

    def _or_default(self, name: str, defaults: dict):
        value = getattr(self, name)
        return value if value is not None else defaults.get(name, _DEFAULTS[name])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _capped(max_tokens: int | None, defaults: dict) -> int | None:
    """max_tokens under the model's generation-config cap, if it has one (vLLM's server does the same)."""
    limit = defaults.get("max_tokens")
    if limit is None:
        return max_tokens
    if max_tokens is None:
        return limit
    return min(max_tokens, limit)


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, description="0 with echo: score the prompt, generate nothing")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = Field(False, description="vLLM's: each choice also gives its token ids (token_ids), "
                                   "and its first event the prompt's (prompt_token_ids)")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description=CONTINUE_FINAL_MESSAGE)
    add_special_tokens: bool = Field(False, description="vLLM's: also add the tokenizer's own special tokens "
                                     "(a BOS) to the rendered template, which usually writes its own")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto when tools are given, else none")
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call in an answer")
    chat_template_kwargs: Annotated[dict[str, Any], Shallow] | None = Field(
        None, description="vLLM's: extra variables for the chat template (Qwen3's enable_thinking, say)")

    def conversation(self, content_format: str) -> list[dict]:
        return conversation(self.messages, content_format)

    @property
    def tool_list(self) -> list[dict]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    @property
    def effective_tool_choice(self) -> str | dict:
        """tool_choice with OpenAI's default; ValueError for a choice without tools."""
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools: a non-empty list of functions")
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or ("auto" if self.tools else "none")

    def _structured_outputs(self) -> dict[str, StructuredOutputsParams]:
        given, tool_choice = super()._structured_outputs(), self.effective_tool_choice  # checks tool_choice
        constraint = tool_constraint(self.tool_list, tool_choice, self.parallel_tool_calls) if self.tools else None
        return given if constraint is None else {**given, "tools": constraint}


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32 bytes")
    dimensions: int | None = Field(None, ge=1, description="keep the first this many values (before normalizing)")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="vLLM's: keep the input's last k tokens")
    normalize: bool | None = Field(None, description="vLLM's: unit length or not; default: the server's "
                                   "--pooler-config")
    request_id: RequestId = None
    priority: Priority = 0

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(self.normalize, self.dimensions, self.truncate_prompt_tokens)
