"""A chat answer's text taken apart as it streams (server/reasoning.py, server/tools.py): however the text is cut
into deltas, the streamed parts add up to what the finished text splits into."""

import json

from hypothesis import given, strategies as st

from jax_engine.server.reasoning import ReasoningStream, split_reasoning
from jax_engine.server.tools import ToolCallStream, tool_constraint

# Text made of the tags' pieces, so that cuts fall inside tags, and tags come whole, partial, doubled or missing.
PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b c"])
TEXTS = st.lists(PIECES, max_size=12).map("".join)


def streamed(parser: str, text: str, cuts: list[int]) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(parser), "", ""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for start, end in zip(bounds, bounds[1:] + [None]):
        r, c = stream.delta(text[start:end] if end is not None else "", finished=end is None)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@given(st.sampled_from(["qwen3", "deepseek_r1"]), TEXTS, st.lists(st.integers(0, 200), max_size=6))
def test_streamed_reasoning_equals_the_split_of_the_whole_text(parser, text, cuts):
    whole = split_reasoning(parser, text)
    assert streamed(parser, text, cuts) == tuple(part or "" for part in whole)


def test_reasoning_parsers_split_as_vllms_do():
    assert split_reasoning("qwen3", "<think>plan</think>answer") == ("plan", "answer")
    assert split_reasoning("qwen3", "answer only") == (None, "answer only")  # thinking switched off
    assert split_reasoning("qwen3", "<think>cut short") == ("cut short", None)
    assert split_reasoning("deepseek_r1", "plan</think>answer") == ("plan", "answer")  # the template opened it
    assert split_reasoning("deepseek_r1", "\n<think>plan</think>") == ("plan", None)
    assert split_reasoning("deepseek_r1", "cut short") == ("cut short", None)


def test_parallel_tool_calls_false_keeps_one_call():
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in "fg"]
    text = '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]</tool_call>'
    for parallel, names in ((True, ["f", "g"]), (False, ["f"])):
        _, calls = ToolCallStream(tools, "auto", parallel).delta(text, finished=True)
        assert [c["function"]["name"] for c in calls] == names
    required = [json.loads(json.dumps(tool_constraint(tools, "required", parallel).json)) for parallel in (True, False)]
    assert "maxItems" not in required[0] and required[1]["maxItems"] == 1
