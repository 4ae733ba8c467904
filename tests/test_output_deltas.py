"""Outputs across the process boundary (engine_core/output_deltas.py): what the API server puts back together from
the deltas is, after every step, the output the engine made, whatever its parts did: grow in place (as the engine's
lists do), get cut (a stop string), or be made anew (beam search's reordered beams)."""

import dataclasses
import pickle

from hypothesis import given, strategies as st

from jax_engine.engine_core.output_deltas import DeltaDecoder, DeltaEncoder
from jax_engine.outputs import CompletionOutput, Logprob, RequestOutput

# What a step does to one completion: append tokens, cut back to a prefix, or start it anew.
changes = st.one_of(st.tuples(st.just("append"), st.integers(1, 3)),
                    st.tuples(st.just("cut"), st.integers(0, 5)),
                    st.tuples(st.just("anew"), st.integers(0, 4)))


class _Completion:
    """A completion as the engine keeps it: lists it appends to in place."""

    def __init__(self, index: int, with_logprobs: bool) -> None:
        self.index, self.text, self.token_ids = index, "", []
        self.logprobs = [] if with_logprobs else None
        self.next_token = 0

    def change(self, kind: str, count: int) -> None:
        if kind == "cut":
            keep = max(len(self.token_ids) - count, 0)
            del self.token_ids[keep:]
            if self.logprobs is not None:
                del self.logprobs[keep:]
            self.text = self.text[: max(len(self.text) - count, 0)]
            return
        if kind == "anew":
            self.token_ids, self.text = [], ""
            self.logprobs = None if self.logprobs is None else []
        for _ in range(count):
            self.next_token += 1
            self.token_ids.append(self.next_token)
            self.text += f"<{self.next_token}>"
            if self.logprobs is not None:
                self.logprobs.append({self.next_token: Logprob(-0.5 * self.next_token, 1, f"<{self.next_token}>")})

    def output(self, finished: bool) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, self.token_ids, -1.0 * len(self.token_ids), self.logprobs,
                                "stop" if finished else None)


def _snapshot(output: RequestOutput) -> dict:
    """The output's values now (the engine and the decoder both go on appending to its lists)."""
    return pickle.loads(pickle.dumps(dataclasses.asdict(output)))


@given(n=st.integers(1, 3), with_logprobs=st.booleans(), with_prompt_logprobs=st.booleans(),
       steps=st.lists(st.lists(changes, min_size=3, max_size=3), min_size=1, max_size=12))
def test_the_api_server_rebuilds_every_output_the_engine_made(n, with_logprobs, with_prompt_logprobs, steps):
    completions = [_Completion(i, with_logprobs) for i in range(n)]
    prompt_logprobs = [None] if with_prompt_logprobs else None
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    decoder.start("r", "a prompt", [7, 8, 9])
    for step, step_changes in enumerate(steps):
        finished = step == len(steps) - 1
        for completion, (kind, count) in zip(completions, step_changes):
            completion.change(kind, count)
        if prompt_logprobs is not None and step < 3:  # a chunked prompt scored over several steps
            prompt_logprobs.append({step: Logprob(-1.0)})
        made = RequestOutput("r", "a prompt", [7, 8, 9], prompt_logprobs, [c.output(finished) for c in completions],
                             finished, step, None)
        sent = pickle.loads(pickle.dumps(encoder.encode(made)))  # as it crosses the socket
        assert _snapshot(decoder.decode(sent)) == _snapshot(made)
    assert len(decoder) == 0 and not encoder._sent  # a finished request leaves nothing behind on either side


def test_a_growing_stream_sends_only_its_new_tokens():
    completion = _Completion(0, with_logprobs=True)
    encoder = DeltaEncoder()
    sizes = []
    for _ in range(200):
        completion.change("append", 1)
        sizes.append(len(pickle.dumps(encoder.encode(RequestOutput("r", "p", [1], None, [completion.output(False)],
                                                                   False)))))
    assert max(sizes[100:]) <= sizes[1] + 16  # constant: not growing with the completion
