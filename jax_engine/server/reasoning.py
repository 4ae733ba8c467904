"""Reasoning output (vLLM's --reasoning-parser): a thinking model's <think>...</think> part goes to the answer's
`reasoning_content`, the rest to `content`.

    parser        the model writes                          where the thinking starts
    deepseek_r1   thinking</think>answer                    at once: the chat template ends in <think> itself
    qwen3         <think>thinking</think>answer, or answer  at a leading <think>; none (thinking switched off
                                                            with chat_template_kwargs enable_thinking=false,
                                                            whose template writes the empty pair): all content

A completion cut before </think> (max_tokens) is all reasoning under deepseek_r1, and all content under qwen3
unless it opened with <think>, as vLLM's parsers do. Streamed, text that may be the start of a tag is held
back until the next delta shows whether it is one.
"""

from dataclasses import dataclass

from jax_engine.server.tools import partial_tag_length

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass
class ReasoningStream:
    """One choice's text, delta by delta, split into (reasoning, content) deltas."""

    parser: str
    _phase: str = "opening"  # "opening" (a leading <think> may come), "reasoning", "content"
    _held: str = ""  # text that may be the start of a tag

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got {self.parser!r}")

    def delta(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) to send for this much more text; everything held is sent once `finished`."""
        text, self._held = self._held + text, ""
        reasoning = content = ""
        if self._phase == "opening":
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                text, self._phase = stripped[len(THINK_START):], "reasoning"
            elif THINK_START.startswith(stripped) and not finished:  # maybe a <think> still coming
                self._held = text
                return "", ""
            else:
                self._phase = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._phase == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                keep = 0 if finished else partial_tag_length(text, THINK_END)
                self._held = text[len(text) - keep:]
                return text[: len(text) - keep], ""
            reasoning, text, self._phase = text[:end], text[end + len(THINK_END):], "content"
        return reasoning, content + text


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """A finished completion's (reasoning_content, content), None for an empty part."""
    reasoning, content = ReasoningStream(parser).delta(text, finished=True)
    return reasoning or None, content or None
