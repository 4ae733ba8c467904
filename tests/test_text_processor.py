"""Text made in the API server (engine_core/text_processor.py) is the text the in-process engine makes.

Two engines on the tiny checkpoint take the same requests: one makes its text itself (as `LLM` does), the other
makes none (as the engine core does) and a TextProcessor makes it from its outputs, telling it of the stop strings
it finds `lag` steps late, as the core hears of them a step or more after it made the token. The tiny model's
byte tokens make text that breaks UTF-8 characters across tokens; the stop strings are picked from its own text.
"""

import pytest

from jax_engine import BeamSearchParams, EngineArgs, LLMEngine, SamplingParams
from jax_engine.engine_core.text_processor import TextProcessor

ARGS = dict(num_gpu_blocks_override=64, block_size=8, max_model_len=96, max_num_seqs=8, enforce_eager=True)
# The tiny model answers "abcabc" with "ccc...", one byte a token: where a stop string ends is known.
PROMPTS = ["hello there", "the quick brown fox", "one two three", "abcabc", "abcabc"]


def _params(stops: list[str]) -> list:
    return [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=24, stop=stops[0], logprobs=2, prompt_logprobs=1),
            SamplingParams(temperature=0, max_tokens=24, stop=stops[1], include_stop_str_in_output=True),
            BeamSearchParams(beam_width=2, max_tokens=6),
            SamplingParams(temperature=0, max_tokens=6, stop="cccccc"),  # the token that reaches max_tokens
            SamplingParams(temperature=0, max_tokens=8, min_tokens=5, stop="ccc")]  # not searched before the 6th


def _run(engine: LLMEngine, params: list, text: TextProcessor | None = None, lag: int = 0,
         dropped: dict | None = None) -> dict:
    """Each request's last output: completions and prompt logprobs. With `text`, made by it, the engine told of the
    stops it finds `lag` steps late; what the engine still sends of a request finished there goes to `dropped`."""
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(str(i), prompt, p)
        if text is not None:
            text.start(str(i), engine.validate_request(prompt, p).prompt_token_ids, p)
    last, untold = {}, [[] for _ in range(lag)]  # untold: the stops of the last `lag` steps
    while engine.has_unfinished_requests():
        found = []
        for output in engine.step():
            if output.request_id in last and last[output.request_id][-1]:
                dropped[output.request_id] = output
                continue
            if text is not None:
                output, stops = text.process(output)
                found += stops
            last[output.request_id] = (output.outputs, output.prompt_logprobs, output.finished)
        untold.append(found)
        engine.stop_sequences(untold.pop(0))
    return last


@pytest.fixture(scope="module")
def in_process(tiny_checkpoint):
    return LLMEngine(EngineArgs(**ARGS), checkpoint=tiny_checkpoint)


@pytest.fixture(scope="module")
def stops(in_process) -> list[str]:
    """A stop string from the middle of the first sample's text, and one from the greedy request's."""
    free = _run(in_process, _params([[], []]))
    texts = [free["0"][0][0].text, free["1"][0][0].text]
    assert all(len(t) >= 8 for t in texts), texts
    return [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]


@pytest.mark.parametrize("lag", [0, 2])
def test_the_api_servers_text_is_the_engines(in_process, tiny_checkpoint, stops, lag):
    assert in_process.reset_prefix_cache()  # computes the prompts as the new engine does, not from the cache
    expected = _run(in_process, _params(stops))
    core = LLMEngine(EngineArgs(**ARGS), checkpoint=tiny_checkpoint, detokenize=False)
    dropped = {}
    got = _run(core, _params(stops), TextProcessor(core.tokenizer), lag, dropped)
    assert got == expected
    # The greedy request stopped here while the core went on for `lag` steps; its last word came too late.
    assert len(dropped["1"].outputs[0].token_ids) == len(got["1"][0][0].token_ids) + lag
    reasons = [(c.finish_reason, c.stop_reason) for completions, _, _ in expected.values() for c in completions]
    assert ("stop", stops[0]) in reasons and ("length", None) in reasons  # some samples stop, others run on
    assert ("stop", stops[1]) in reasons
    at_max, waited = expected["3"][0][0], expected["4"][0][0]
    assert (at_max.text, len(at_max.token_ids), at_max.finish_reason, at_max.stop_reason) == ("", 6, "stop", "cccccc")
    assert (waited.text, len(waited.token_ids), waited.finish_reason, waited.stop_reason) == ("ccc", 6, "stop", "ccc")
    assert core.get_num_unfinished_requests() == 0 and core.scheduler.kv.usage == 0  # the stops freed every block

