"""The chat template: a conversation rendered into one prompt, as vLLM renders it.

The template is the checkpoint's (chat_template.jinja, tokenizer_config.json or the GGUF metadata), or the
caller's: `LLM.chat(chat_template=...)` takes a template's text, `jax-engine serve --chat-template` a file or
the text itself (load_chat_template). A model with neither cannot chat: the error says how to give it one.
"""

from pathlib import Path

from jax_engine.input_checks import check

# apply_chat_template's own arguments: chat_template_kwargs may not change how the template is chosen, what it is
# given or how the text is tokenized, only set variables the template reads (enable_thinking, say).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})

NO_TEMPLATE = ("this model has no chat template (its tokenizer files hold none): give one, as LLM.chat's "
               "chat_template or `jax-engine serve --chat-template FILE`, or send a plain prompt instead")


def check_template_kwargs(kwargs) -> dict:
    """chat_template_kwargs as given (None: {}), or a ValueError naming the field and the key it may not set."""
    kwargs = {} if kwargs is None else kwargs
    check(isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs), "chat_template_kwargs",
          "a dict with string keys", type(kwargs).__name__)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: it is an argument of the chat "
                         "template's rendering, not a template variable")
    return kwargs


def check_has_template(tokenizer, chat_template: str | None) -> None:
    """A ValueError saying how to give one when neither `chat_template` nor the tokenizer holds a template."""
    if chat_template is None and not tokenizer.chat_template:
        raise ValueError(NO_TEMPLATE)


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: a final message to continue and a new assistant turn to open exclude each other."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt to false to have the model continue the last message")


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
              chat_template_kwargs: dict | None = None, *, chat_template: str | None = None,
              continue_final_message: bool = False) -> str:
    """A conversation through the chat template: `chat_template` if given, else the tokenizer's own.

    `chat_template_kwargs` are extra template variables (Qwen3's enable_thinking, say). `continue_final_message`
    leaves the last message open (no end-of-turn after it), for the model to go on writing it.
    """
    check_has_template(tokenizer, chat_template)
    check_continuation(add_generation_prompt, continue_final_message)
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         **({"tools": tools} if tools else {}),
                                         **check_template_kwargs(chat_template_kwargs))


def chat_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                add_special_tokens: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None, **template) -> dict:
    """A conversation through the chat template (chat_text; `template`: its chat_template and
    continue_final_message), tokenized once: vLLM's TokensPrompt with its text.

    The template writes the special tokens it wants (a BOS among them), so the text is encoded without the
    tokenizer's own (vLLM's rule): encoding it as a plain prompt would give BOS-adding tokenizers two.
    """
    text = chat_text(tokenizer, messages, add_generation_prompt, tools, chat_template_kwargs, **template)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`'s value as a template: a file's contents, or the value itself (vLLM's rule: a value that
    names no readable file is a template if it holds a brace or a newline, and its backslash escapes such as \\n
    are read as in a Python string). It is compiled here, so that a template with a syntax error stops the start
    instead of failing every chat request."""
    if value is None:
        return None
    try:
        text = Path(value).read_text()
    except (OSError, ValueError) as error:  # ValueError: a NUL in the value
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file's path, but it cannot be read: {error}"
                             ) from None
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")  # keeps non-ASCII text
    from transformers.utils.chat_template_utils import _compile_jinja_template  # what apply_chat_template uses

    try:
        _compile_jinja_template(text)
    except Exception as error:  # jinja2's TemplateSyntaxError
        raise ValueError(f"--chat-template is not a valid Jinja template: {error}") from None
    return text
