"""The API server's half of output processing (vLLM v1's front-end OutputProcessor): text, stop strings, and the
decoded tokens of logprobs, made from the token ids the engine core sends.

Across processes the core schedules, steps and samples, and sends token ids and logprobs without text
(LLMEngine(detokenize=False)). This process turns them into what users read, with the incremental detokenizer
and stop-string search the in-process engine uses (jax_engine/detokenizer.py), so the core spends no time on it.

A stop string is found here a step or more after the core made the token that completed it. That completion
finishes here at once: its text and tokens are cut at the stop, and the tokens the core made since are dropped.
The core is told to stop the sequence ("stop"), to free its blocks. A request all of whose completions have
finished is reported finished; what the core still sends of it is not looked at.
"""

from dataclasses import dataclass, field, replace

from jax_engine.beam_search import BeamSearchParams
from jax_engine.detokenizer import (IncrementalDetokenizer, NoDetokenizer, cut_at_stop, decoded_text, decoded_token,
                                    find_stop_string, searches_stop_strings)
from jax_engine.outputs import CompletionOutput, Logprob, PositionLogprobs
from jax_engine.sampling_params import SamplingParams

Stop = tuple[str, int, str]  # (request id, completion index, the stop string): the core's "stop" message


@dataclass
class _CompletionText:
    detokenizer: IncrementalDetokenizer | NoDetokenizer
    seen: int = 0  # tokens detokenized (their logprobs decoded)
    stopped: CompletionOutput | None = None  # its last output, once a stop string ended it here


@dataclass
class _RequestText:
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    completions: dict[int, _CompletionText] = field(default_factory=dict)
    prompt_logprobs_seen: int = 0


class TextProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestText] = {}  # per request started and not finished

    def start(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        """Take a request sent to the core (params of a pooling request: nothing to make text of)."""
        if isinstance(params, (SamplingParams, BeamSearchParams)):
            self._requests[request_id] = _RequestText(prompt_token_ids, params)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, output) -> tuple[object, list[Stop]]:
        """`output` (the core's, whole) with its text made, and the stops to tell the core of. An output is
        finished when the core says so or when its last running completion reached a stop string here."""
        request = self._requests.get(output.request_id)
        if request is None:  # an embedding
            return output, []
        stops = []
        completions = [self._completion(request, c, output.request_id, stops) for c in output.outputs]
        self._decode_prompt_logprobs(request, output.prompt_logprobs)
        finished = output.finished or (not isinstance(request.params, BeamSearchParams) and
                                       all(c.finish_reason is not None for c in completions))
        if finished:
            self.forget(output.request_id)
        return replace(output, outputs=completions, finished=finished), stops

    def _completion(self, request: _RequestText, c: CompletionOutput, request_id: str,
                    stops: list[Stop]) -> CompletionOutput:
        if isinstance(request.params, BeamSearchParams):  # beams reorder: their text is made anew
            return replace(c, text=decoded_text(self.tokenizer, c.token_ids))
        state = request.completions.get(c.index)
        if state is None:
            state = request.completions[c.index] = _CompletionText(self._detokenizer(request))
        if state.stopped is not None:
            return state.stopped
        params = request.params
        for position in range(state.seen, len(c.token_ids)):
            if c.logprobs is not None:
                c.logprobs[position] = self._decoded_entry(c.logprobs[position])
            new_text = state.detokenizer.add_token(c.token_ids[position])
            state.seen += 1
            # The token that ended the sequence in the core as EOS or a stop token is not searched, as in the
            # in-process engine (output_processor.py); one that reached max_tokens is.
            ended = c.finish_reason not in (None, "length") and position == len(c.token_ids) - 1
            found = (new_text and searches_stop_strings(params, position + 1, ended)
                     and find_stop_string(state.detokenizer.text, len(new_text), params.stop))
            if found:
                state.stopped = _cut(c, position + 1, cut_at_stop(state.detokenizer.text, *found,
                                                                  params.include_stop_str_in_output), found[1])
                stops.append((request_id, c.index, found[1]))
                return state.stopped
        return replace(c, text=state.detokenizer.text)

    def _detokenizer(self, request: _RequestText) -> IncrementalDetokenizer | NoDetokenizer:
        if self.tokenizer is None:
            return NoDetokenizer()
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens)

    def _decode_prompt_logprobs(self, request: _RequestText, prompt_logprobs: list | None) -> None:
        for position in range(request.prompt_logprobs_seen, len(prompt_logprobs or ())):
            if prompt_logprobs[position] is not None:  # position 0 has no score
                prompt_logprobs[position] = self._decoded_entry(prompt_logprobs[position])
        request.prompt_logprobs_seen = len(prompt_logprobs or ())

    def _decoded_entry(self, entry: PositionLogprobs) -> PositionLogprobs:
        return {token: Logprob(lp.logprob, lp.rank, decoded_token(self.tokenizer, token))
                for token, lp in entry.items()}


def _cut(c: CompletionOutput, length: int, text: str, stop: str) -> CompletionOutput:
    """Completion `c` ended by a stop string after its first `length` tokens (the core made the rest meanwhile)."""
    token_ids, logprobs, cumulative = c.token_ids[:length], None, None
    if c.logprobs is not None:  # the kept tokens' sum, added in the order the core adds them
        logprobs, cumulative = c.logprobs[:length], 0.0
        for token, entry in zip(token_ids, logprobs):
            cumulative += entry[token].logprob
    return CompletionOutput(c.index, text, token_ids, cumulative, logprobs, "stop", stop)
