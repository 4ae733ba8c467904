"""How a chat message's content reaches the chat template: vLLM's --chat-template-content-format.

A message's content is a string or a list of parts (`[{"type": "text", "text": ...}, ...]`, OpenAI's form).
Templates read it one of two ways, and each must be given the form it reads:

    string   `{{ message['content'] }}`: the parts' texts joined with newlines (a list would print as Python)
    openai   `{% for part in message['content'] %}`: a list of text parts (a string content becomes one part)

"auto" (the default) reads the template's Jinja syntax tree as vLLM does: a loop over a message's content makes it
"openai", else "string".
"""

import functools
import logging

from jinja2 import nodes

from jax_engine.input_checks import check

CONTENT_FORMATS = ("auto", "string", "openai")
TEXT_PART_TYPE = "text"

logger = logging.getLogger(__name__)


def check_content_format(value: str) -> str:
    check(value in CONTENT_FORMATS, "chat_template_content_format", f"one of {', '.join(CONTENT_FORMATS)}", value)
    return value


def template_text(tokenizer, chat_template: str | None, tools: list[dict] | None = None) -> str | None:
    """The template a chat renders with: `chat_template`, else the tokenizer's (None if neither)."""
    if chat_template is not None or tokenizer is None or not tokenizer.chat_template:
        return chat_template
    return tokenizer.get_chat_template(tools=tools)


def resolve_content_format(given: str, template: str | None) -> str:
    """`given`, or with "auto" the form `template` reads (detect_content_format; "string" without a template)."""
    if check_content_format(given) != "auto":
        return given
    return "string" if template is None else detect_content_format(template)


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """"openai" if the template loops over a message's content, else "string" (also for a template that does not
    parse: rendering it will say why)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template  # the environment it renders in

    try:
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # jinja2's TemplateSyntaxError
        return "string"
    loops, messages = list(tree.find_all(nodes.For)), _messages_names(tree)
    message_names = {_name(loop.target) for loop in loops if _reads(loop.iter, messages)} - {None}
    parts_loop = any(_reads(loop.iter, message_names, "content") or _reads(loop.iter, {"content"}) for loop in loops)
    detected = "openai" if parts_loop else "string"
    logger.info("the chat template reads message content as %r (--chat-template-content-format overrides it)",
                detected)
    return detected


def _messages_names(tree: nodes.Template) -> set[str]:
    """`messages` and every variable set from it (`{% set loop_messages = messages[1:] %}`), transitively."""
    names, assigns = {"messages"}, list(tree.find_all(nodes.Assign))
    while new := {_name(a.target) for a in assigns if _reads(a.node, names)} - names - {None}:
        names |= new
    return names


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (its `key` item or attribute when given), through filters, tests and
    slices: `messages | reverse`, `message['content'][1:]`, `message.content`."""
    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        item = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        if not (item or isinstance(node, nodes.Getattr) and node.attr == key):
            return False
        node = node.node
    return isinstance(node, nodes.Name) and node.name in names


def _name(target: nodes.Node) -> str | None:
    return target.name if isinstance(target, nodes.Name) else None


def template_content(texts: list[str], content_format: str) -> str | list[dict]:
    """A message's text parts in the form the template reads."""
    if content_format == "openai":
        return [{"type": TEXT_PART_TYPE, "text": text} for text in texts]
    return "\n".join(texts)


def template_messages(messages: list[dict], content_format: str) -> list[dict]:
    """LLM.chat's messages with their content in `content_format`: each content a string, None or a list of text
    parts (a ValueError names the first that is none of these)."""
    return [{**message, "content": template_content(_texts(message.get("content"), f"messages[{i}].content"),
                                                    content_format)}
            for i, message in enumerate(messages)]


def _texts(content, field: str) -> list[str]:
    """A content's texts: a string's, or each part's (a text part, or a bare string as vLLM also takes)."""
    if content is None or isinstance(content, str):
        return [] if content is None else [content]
    check(isinstance(content, list), field, "a string, None or a list of text parts", type(content).__name__)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        check(isinstance(part, str) or kind == TEXT_PART_TYPE and isinstance(part.get("text"), str), f"{field}[{j}]",
              '{"type": "text", "text": "..."} (this engine serves text: no images or audio)', kind)
    return [part if isinstance(part, str) else part["text"] for part in content]
