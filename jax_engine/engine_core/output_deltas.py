"""A request's outputs sent as what changed since the last one, and put back together on the other side.

A RequestOutput is cumulative: all of its completions' text, tokens and logprobs so far. Sent whole after every
step, a 4000-token stream with 20 logprobs a token would cost the two processes O(n^2) pickling: seconds a step
by its end. So the core sends, per completion, where each part stops matching what it sent last and what follows
(usually: nothing stops matching, and the new token is all that follows), and the API server keeps the whole
output and applies them. Parts only grow, except where a stop string cuts the text (and the tokens past it) or a
beam search reorders its beams: then the part is sent whole again.

Lists are kept by identity as the engine keeps them: the engine appends to a sequence's token and logprob lists
in place, so a list the encoder saw before and has not shrunk has only grown, and only its tail is new.
"""

from dataclasses import dataclass

from jax_engine.outputs import CompletionOutput, RequestOutput


@dataclass
class Tail:
    """A list or string part: keep the first `keep` items of the last one, then add `items`."""

    keep: int
    items: object


@dataclass
class CompletionDelta:
    index: int
    text: Tail
    token_ids: Tail
    logprobs: Tail | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class OutputDelta:
    """A RequestOutput less what the API server has already (its prompt, and the parts sent before)."""

    request_id: str
    prompt_logprobs: Tail | None
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    metrics: object


class _Sent:
    """What was sent of one list part: the list (by identity) and how long it was."""

    __slots__ = ("part", "length")

    def __init__(self) -> None:
        self.part, self.length = None, 0

    def tail(self, part: list | None) -> Tail | None:
        if part is None:
            return None
        keep = self.length if part is self.part and len(part) >= self.length else 0
        self.part, self.length = part, len(part)
        return Tail(keep, part[keep:])


class DeltaEncoder:
    """The core's side: turns each RequestOutput into an OutputDelta against what it sent before."""

    def __init__(self) -> None:
        self._sent: dict[str, dict] = {}  # per unfinished request: what was sent of each part

    def encode(self, output):
        if not isinstance(output, RequestOutput):  # an embedding is sent once, whole
            return output
        sent = self._sent.pop(output.request_id, {}) if output.finished else \
            self._sent.setdefault(output.request_id, {})
        return OutputDelta(output.request_id, _list_tail(sent, "prompt_logprobs", output.prompt_logprobs),
                           [self._completion(sent, c) for c in output.outputs], output.finished,
                           output.num_cached_tokens, output.metrics)

    @staticmethod
    def _completion(sent: dict, c: CompletionOutput) -> CompletionDelta:
        text = sent.get(("text", c.index), "")
        keep = len(text) if c.text.startswith(text) else 0
        sent[("text", c.index)] = c.text
        return CompletionDelta(c.index, Tail(keep, c.text[keep:]), _list_tail(sent, ("tokens", c.index), c.token_ids),
                               _list_tail(sent, ("logprobs", c.index), c.logprobs), c.cumulative_logprob,
                               c.finish_reason, c.stop_reason)


def _list_tail(sent: dict, key, part: list | None) -> Tail | None:
    return sent.setdefault(key, _Sent()).tail(part)


class DeltaDecoder:
    """The API server's side: applies each OutputDelta to the request's whole output, and returns that."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}  # per unfinished request: its output so far

    def start(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self._outputs[request_id] = RequestOutput(request_id, prompt, prompt_token_ids, None, [], False)

    def forget(self, request_id: str) -> RequestOutput | None:
        return self._outputs.pop(request_id, None)

    def __len__(self) -> int:
        """Requests started and not finished."""
        return len(self._outputs)

    def decode(self, delta):
        """The request's whole output after `delta`; None for a request this side has forgotten (finished here)."""
        if delta.request_id not in self._outputs:
            return None
        if not isinstance(delta, OutputDelta):  # an embedding: sent once, whole
            del self._outputs[delta.request_id]
            return delta
        whole = self._outputs.pop(delta.request_id) if delta.finished else self._outputs[delta.request_id]
        completions = {c.index: c for c in whole.outputs}
        for d in delta.completions:
            before = completions.get(d.index)
            completions[d.index] = CompletionOutput(
                d.index, _applied(before and before.text, d.text), _applied(before and before.token_ids, d.token_ids),
                d.cumulative_logprob, _applied(before and before.logprobs, d.logprobs), d.finish_reason,
                d.stop_reason)
        whole.prompt_logprobs = _applied(whole.prompt_logprobs, delta.prompt_logprobs)
        whole.outputs = [completions[d.index] for d in delta.completions]
        whole.finished, whole.num_cached_tokens, whole.metrics = delta.finished, delta.num_cached_tokens, delta.metrics
        return RequestOutput(whole.request_id, whole.prompt, whole.prompt_token_ids, whole.prompt_logprobs,
                             whole.outputs, whole.finished, whole.num_cached_tokens, whole.metrics)


def _applied(before, tail: Tail | None):
    """The part after `tail`: a string anew; a list extended in place when it only grew (as the engine's are)."""
    if tail is None:
        return None
    if isinstance(tail.items, str):
        return (before or "")[: tail.keep] + tail.items
    if before is not None and tail.keep == len(before):
        before.extend(tail.items)
        return before
    return (before or [])[: tail.keep] + tail.items
