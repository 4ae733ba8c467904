"""vLLM's --chat-template-content-format: "auto" reads the template's Jinja tree, and each message's content (a
string, None or a list of text parts) reaches the template in the form it reads. Over HTTP and through LLM.chat:
tests/test_server_vllm_fields.py and tests/test_llm.py."""

import pytest

from jax_engine.chat_content import detect_content_format, resolve_content_format, template_messages
from jax_engine.server.tools import with_tools
from tests.tiny_checkpoints import CHAT_TEMPLATE

LOOPS_OVER_PARTS = {
    "message['content']": "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "an attribute, filtered": "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text')"
                              " %}{{ p.text }}{% endfor %}{% endfor %}",
    "messages set, sliced": "{% set rest = messages[1:] %}{% set turns = rest %}{% for m in turns %}"
                            "{% for p in m['content'][1:] %}{{ p.text }}{% endfor %}{% endfor %}",
    "a macro's content": "{% macro show(content) %}{% for item in content %}{{ item.text }}{% endfor %}{% endmacro %}"
                         "{% for m in messages %}{{ show(m['content']) }}{% endfor %}",
}
READS_A_STRING = {
    "message['content']": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "a loop over something else": "{% for m in messages %}{% for t in tools %}{{ t }}{% endfor %}"
                                  "{{ m.content }}{% endfor %}",
    "a loop over content not a message's": "{% for p in documents[0]['content'] %}{{ p }}{% endfor %}",
    "not a template": "{% for m in messages %}",
}


@pytest.mark.parametrize("template", LOOPS_OVER_PARTS.values(), ids=LOOPS_OVER_PARTS)
def test_a_loop_over_a_messages_content_reads_parts(template):
    assert detect_content_format(template) == "openai"


@pytest.mark.parametrize("template", READS_A_STRING.values(), ids=READS_A_STRING)
def test_other_templates_read_a_string(template):
    assert detect_content_format(template) == "string"


def test_the_tiny_checkpoints_template_reads_a_string_and_a_given_format_wins():
    template = CHAT_TEMPLATE
    assert resolve_content_format("auto", template) == "string"
    assert resolve_content_format("openai", template) == "openai"
    assert resolve_content_format("auto", None) == "string"  # no template: chat refuses anyway, naming why
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        resolve_content_format("text", template)


def test_contents_take_the_form_the_template_reads():
    """vLLM's rules: "string" joins the parts' texts with newlines (None is empty); "openai" makes every content a
    list of text parts (a string is one part, None none)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},  # vLLM takes a bare string too
                {"role": "assistant", "content": None, "tool_calls": []}, {"role": "user", "content": "c"}]
    assert template_messages(messages, "string") == [{"role": "user", "content": "a\nb"},
                                                     {"role": "assistant", "content": "", "tool_calls": []},
                                                     {"role": "user", "content": "c"}]
    assert [m["content"] for m in template_messages(messages, "openai")] == [
        [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], [], [{"type": "text", "text": "c"}]]


@pytest.mark.parametrize("content, field, shown", [
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}], r"content\[1\]", "'image_url'"),
    ([{"type": "text", "text": 3}], r"content\[0\]", "'text'"),
    ([7], r"content\[0\]", "'int'"),
    ({"type": "text", "text": "a"}, "content", "'dict'"),
])
def test_a_part_that_is_no_text_is_refused_naming_it(content, field, shown):
    with pytest.raises(ValueError, match=rf"messages\[1\].{field} must be .*, got {shown}"):
        template_messages([{"role": "system", "content": "s"}, {"role": "user", "content": content}], "string")


def test_the_tools_description_joins_a_system_message_in_the_templates_form():
    """A template that does not render `tools` gets them described in the system message (server/tools.py):
    appended to the one the client wrote, as text or as one more text part."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    for content_format in ("string", "openai"):
        written = template_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                    content_format)
        system, user = with_tools(written, [tool], False, content_format)
        [described] = template_messages([with_tools([], [tool], False, "string")[0]], content_format)
        assert user == written[1] and "get_weather" in str(described["content"])
        if content_format == "string":
            assert system["content"] == f"Be brief.\n\n{described['content']}"
        else:
            assert system["content"] == [{"type": "text", "text": "Be brief."}, *described["content"]]
