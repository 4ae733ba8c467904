"""Speculative decoding in the engine (issue 44): drafts verified in one step change no output.

The engine verifies a draft by sampling its position as plain decoding would (jax_engine/spec_decode/
verification.py), so greedy and seeded output must equal the output without speculation token for token, with
logprobs, stop strings, penalties, n > 1, preemption and chunked prefill, while fewer steps run.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from jax_engine import LLM, EngineArgs, LLMEngine, SamplingParams
from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.cli import build_parser
from jax_engine.core.kv_cache_manager import KVCacheManager
from jax_engine.server.data_parallel import DataParallelEngine
from jax_engine.server.server_config import ServerConfig
from jax_engine.spec_decode.ngram_proposer import propose_ngram
from jax_engine.loader import load_checkpoint
from reference import LlamaModel, speculative
from tests.server_helpers import TINY_ENGINE_ARGS, ThreadedServer, cli_flags
from tests.tiny_checkpoints import make_tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TINY_ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128, num_gpu_blocks_override=64,
                 block_size=4, enforce_eager=True)
# Repetitive text: the tiny random model falls into loops that prompt lookup then predicts.
PROMPTS = ["abcabcabcabc", "the cat the cat the cat", "xyz", "0101010101"]


def make(checkpoint, **kwargs) -> LLM:
    return LLM.from_engine(LLMEngine(EngineArgs(**{**TINY_ARGS, **kwargs}), checkpoint=checkpoint))


def completions(llm: LLM, params) -> list:
    """Tokens, text and finish reason exactly; the logprobs of the emitted tokens to 1e-4 (float32 logits computed
    in another batch shape, as a verification step or a recompute after preemption computes them, differ in their
    last bits)."""
    return [[(c.token_ids, c.text, c.finish_reason, pytest.approx(c.cumulative_logprob, abs=1e-4),
              [pytest.approx(next(iter(p.values())).logprob, abs=1e-4) for p in c.logprobs or []])
             for c in out.outputs] for out in llm.generate(PROMPTS, params, use_tqdm=False)]


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded, top-p, n=2, logprobs": SamplingParams(temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=24,
                                                   ignore_eos=True, logprobs=2),
    "penalties and a stop string": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                  repetition_penalty=1.3, presence_penalty=0.5, stop=["ca"]),
    # The first prompt's greedy answer is "ccc...": the stop string ends inside a run of accepted drafts, and the
    # tokens verified after it are dropped.
    "a stop string among accepted drafts": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                          stop=["ccccc"]),
    # Its 8th token completes the stop string and the 9th reaches max_tokens: both are accepted in one step, which
    # the scheduler has already ended for its length.
    "a stop string in the step that reaches max_tokens": SamplingParams(temperature=0, max_tokens=9,
                                                                        ignore_eos=True, stop=["cccccccc"]),
    # One token a byte: after "t" only "h" may follow, so each drafted position needs the mask after the drafts
    # before it (one mask for all would emit a token the grammar rejects); drafts the grammar forbids (the
    # prompts' "x", "y", "z") are never verified.
    "a grammar at every drafted position": SamplingParams(temperature=0, max_tokens=24, structured_outputs=dict(
        regex="(abc|the cat |01)+")),
}


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    llm = make(tiny_checkpoint)
    return {name: completions(llm, params) for name, params in PARAMS.items()}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    """A draft for the tiny model: its tokenizer and shapes, other random weights. (The tiny model repeats the
    prompt's last character; so would a one-layer draft, which then agrees on every token. This one accepts
    about 70%.)"""
    directory = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_checkpoint(directory, "llama", seed=1)
    return str(directory)


def draft_config(draft_dir: str, **kwargs) -> dict:
    return {"model": draft_dir, "num_speculative_tokens": 3, **kwargs}


SMALL_CACHE = dict(num_gpu_blocks_override=12, max_model_len=48, max_num_batched_tokens=48)  # 48 tokens: preempts


@pytest.mark.parametrize("variant", [{}, {**SMALL_CACHE, "preemption_mode": "recompute"},
                                     {**SMALL_CACHE, "preemption_mode": "swap"},
                                     {"max_num_batched_tokens": 8, "enable_chunked_prefill": True}],
                         ids=["roomy", "recompute", "swap", "chunked"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_output_equals_plain_output(tiny_checkpoint, draft_dir, plain, variant, method):
    config = NGRAM if method == "ngram" else draft_config(draft_dir)
    llm = make(tiny_checkpoint, speculative_config=config, **variant)
    for name, params in PARAMS.items():
        assert completions(llm, params) == plain[name], name
    stats = llm.llm_engine.stats()
    spec = stats["spec_decode"]
    assert spec["num_accepted_tokens"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
    assert 1 < spec["mean_acceptance_length"] <= 1 + NGRAM["num_speculative_tokens"]
    if "preemption_mode" in variant:
        assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]  # every block back, rejected lookahead included
    if method == "draft_model":  # and every block of the draft's cache
        draft = llm.llm_engine.speculator.draft
        assert not draft.states and draft.cache.device.num_free_blocks == draft.cache.device.num_blocks


def test_speculation_runs_fewer_steps_and_compiles_nothing_after_start_up(tiny_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = {}
    for name, config in (("plain", None), ("ngram", NGRAM), ("self", {"model": "self", "num_speculative_tokens": 3})):
        # No compilation cache: programs that eager engines of this process compiled must not be saved (see the note
        # in compile_shapes._bypassing_jax_cache); start-up compiles them itself. 8 tokens a step: the prompt (13
        # tokens) is computed in chunks, by the draft too, whose first catch-up step samples nothing.
        llm = make(tiny_checkpoint, speculative_config=config, enforce_eager=False, compilation_cache_dir="",
                   max_num_batched_tokens=8)
        runs[name] = (llm.generate(["abcabcabcabc"], params, use_tqdm=False)[0].outputs[0].token_ids,
                      llm.llm_engine.num_steps, llm.llm_engine.stats()["num_compilations"])
    for name in ("ngram", "self"):
        assert runs[name][0] == runs["plain"][0]
        assert runs[name][1] < runs["plain"][1]
        assert runs[name][2] == runs["plain"][2] == 0  # the verification rows and the draft's steps: at start-up


def test_a_grammar_drafts_only_what_it_allows_and_masks_each_drafted_position(tiny_checkpoint):
    llm = make(tiny_checkpoint, speculative_config=NGRAM)
    params = PARAMS["a grammar at every drafted position"]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert {o.outputs[0].finish_reason for o in outputs} <= {"length", "stop"}  # none failed: "error"
    spec = llm.llm_engine.stats()["spec_decode"]
    assert spec["num_accepted_tokens"] > 0  # constrained requests drafted, and drafts were accepted
    matcher = llm.llm_engine.grammar_compiler.matcher(llm.llm_engine.grammar_compiler.compile(
        params.structured_outputs))
    tokens = llm.get_tokenizer().encode("abcxabc", add_special_tokens=False)
    assert matcher.valid_prefix(tokens) == tokens[:3]  # "x" and all after it cut
    assert matcher.valid_prefix(tokens[:3]) == tokens[:3] and matcher.error is None  # the matcher did not move


def test_a_grammar_whose_masks_cost_too_much_is_stopped_on_drafted_rows_too(tiny_checkpoint):
    """A 300,000-character const costs ~60 ms a mask and no fuel (structured_output/mask_budget.py: the limit is
    20 ms). After its first token the prompt's own "zzz" is drafted at every step, and the library walks a drafted
    row's masks on its own threads: the row is timed there too, and stopped."""
    llm = make(tiny_checkpoint, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": {"const": "z" * 300_000}})
    [output] = llm.generate(['"zzzzzzzzzzzz'], params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "error", output.outputs[0]
    assert re.match(r"structured output stopped: a mask took \d+ ms of CPU, more than the limit of 20 ms",
                    output.outputs[0].stop_reason)


def test_drafting_stops_at_disable_by_batch_size(tiny_checkpoint):
    llm = make(tiny_checkpoint, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)  # two run together the whole time: no drafts
    assert llm.llm_engine.stats()["spec_decode"]["num_drafts"] == 0
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert llm.llm_engine.stats()["spec_decode"]["num_drafts"] > 0


# ------------------------------------------------------------------------------------------ draft models
def greedy_engine(checkpoint, config: dict) -> LLMEngine:
    """An engine speculating with `config` at every batch size, holding PROMPTS as greedy requests."""
    engine = LLMEngine(EngineArgs(**TINY_ARGS, speculative_config={**config, "disable_by_batch_size": None}),
                       checkpoint=checkpoint)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, PARAMS["greedy"])
    return engine


def test_the_draft_model_proposes_the_oracles_drafts_at_every_step(tiny_checkpoint, draft_dir):
    """The engine's draft keeps a paged cache of its own, catches up on the verified tokens and rolls back the
    rejected ones; the oracle's recomputes the whole context for every draft. They must draft the same tokens."""
    draft = load_checkpoint(draft_dir)
    oracle = speculative.DraftModelProposer(LlamaModel(draft.config, draft.weights), 3)
    engine = greedy_engine(tiny_checkpoint, draft_config(draft_dir))
    compared = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running.items:
            if seq.num_computed_tokens == seq.num_tokens - 1:  # it sampled: the next step verifies its drafts
                room = seq.max_tokens - seq.num_output_tokens - 1
                assert seq.spec_token_ids == oracle.propose(seq.all_token_ids, room), seq.request_id
                compared += 1
    spec = engine.stats()["spec_decode"]
    assert compared >= 20 and 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]  # kept and rolled back


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_target_drafting_for_itself(tiny_checkpoint, plain, quantization):
    """"self": the target's own checkpoint drafts. In the target's weights every draft is accepted; in int8
    most are, and the output is the target's either way."""
    llm = make(tiny_checkpoint, speculative_config={"model": "self", "quantization": quantization,
                                                    "num_speculative_tokens": 3, "disable_by_batch_size": None})
    assert completions(llm, PARAMS["greedy"]) == plain["greedy"]
    spec = llm.llm_engine.stats()["spec_decode"]
    assert spec["acceptance_rate"] == 1.0 if quantization is None else spec["acceptance_rate"] > 0.5


def test_a_draft_cache_without_room_drafts_nothing_for_that_sequence(tiny_checkpoint, draft_dir, plain):
    llm = make(tiny_checkpoint, speculative_config=draft_config(draft_dir, disable_by_batch_size=None))
    draft = llm.llm_engine.speculator.draft
    draft.cache = KVCacheManager(5, draft.cache.block_size)  # 20 tokens: "the cat the cat the cat" never fits
    assert completions(llm, PARAMS["greedy"]) == plain["greedy"]
    assert llm.llm_engine.stats()["spec_decode"]["num_drafts"] > 0  # the others drafted
    assert draft.cache.device.num_free_blocks == 5


def test_a_draft_that_cannot_draft_for_the_target_fails_at_start_up(tiny_checkpoint, tmp_path):
    make_tiny_checkpoint(tmp_path / "vocab", "llama", vocab_size=300)
    make_tiny_checkpoint(tmp_path / "short", "llama", max_position_embeddings=64)
    for draft, message in ((tmp_path / "vocab", "must share the target's tokenizer"),
                           (tmp_path / "short", "max_position_embeddings 64, fewer than max_model_len")):
        with pytest.raises(ValueError, match=message):
            make(tiny_checkpoint, speculative_config={"model": str(draft), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="nnodes must be 1"):
        EngineArgs(nnodes=2, speculative_config={"model": "self", "num_speculative_tokens": 2})


@given(st.lists(st.integers(0, 3), max_size=30), st.integers(0, 5), st.integers(1, 3), st.integers(0, 3))
def test_ngram_proposer_follows_the_oracle(tokens, k, lookup_min, extra):
    assert propose_ngram(tokens, k, lookup_min, lookup_min + extra) == speculative.propose_ngram(
        tokens, k, lookup_min, lookup_min + extra)


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "model": "self", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"model": "self", "quantization": "int4", "num_speculative_tokens": 2}, "quantization"),
    ({"method": "ngram", "quantization": "int8", "num_speculative_tokens": 2}, "quantization"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_configs_fail_at_start_up_naming_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=config)


def test_vllm_defaults_and_the_command_line_flag():
    args = EngineArgs(speculative_config={"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (args.speculative.method, args.speculative.prompt_lookup_min, args.speculative.prompt_lookup_max) == (
        "ngram", 4, 4)
    defaults = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative
    assert (defaults.prompt_lookup_min, defaults.disable_by_batch_size) == (5, 8)  # 8: measured, docs/benchmarks.md
    draft = EngineArgs(speculative_config={"model": "self", "num_speculative_tokens": 2}).speculative
    assert (draft.method, draft.disable_by_batch_size) == ("draft_model", 5)  # 5: measured too
    never = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None}
    assert EngineArgs(speculative_config=never).speculative.disable_by_batch_size is None
    ns = build_parser().parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    assert EngineArgs.from_cli_args(ns).speculative_config == NGRAM


# ---------------------------------------------------------------------------------- the server's /metrics
def served_engine(checkpoint, *flags: str) -> AsyncLLMEngine:
    """The engine `jax-engine serve FLAGS` would build (the tiny server flags, then FLAGS), on the tiny model."""
    ns = build_parser().parse_args(["serve", *cli_flags(**TINY_ENGINE_ARGS), *flags])
    return AsyncLLMEngine(LLMEngine(EngineArgs.from_cli_args(ns), checkpoint=checkpoint))


def spec_decode_samples(url: str) -> dict:
    """{engine label: {(sample name, position label or None): value}} of every vllm:spec_decode_ sample on
    /metrics (one engine label per data-parallel replica)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    samples = {}
    for family in families:
        for s in family.samples:
            if family.name.startswith("vllm:spec_decode_") and s.name.endswith("_total"):
                assert s.labels["model_name"] == "tiny"
                samples.setdefault(s.labels["engine"], {})[s.name, s.labels.get("position")] = s.value
    return samples


SERVED_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
SPEC_DECODE_SAMPLES = [("vllm:spec_decode_num_drafts_total", None), ("vllm:spec_decode_num_draft_tokens_total", None),
                       ("vllm:spec_decode_num_accepted_tokens_total", None),
                       *(("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p)) for p in range(3))]


def expected_samples(counted: dict) -> dict:
    """What /metrics should show for Speculator.stats() `counted`, in SPEC_DECODE_SAMPLES' order."""
    return dict(zip(SPEC_DECODE_SAMPLES, [counted["num_drafts"], counted["num_draft_tokens"],
                                          counted["num_accepted_tokens"], *counted["num_accepted_tokens_per_pos"]]))


def complete_greedily(url: str, prompts: list[str]) -> None:
    """The prompts, sent together (so that data-parallel replicas each get some) with the openai client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0,
                                                          extra_body={"ignore_eos": True}), prompts))


def test_metrics_report_what_the_speculator_counted_and_only_when_speculating(tiny_checkpoint):
    with ThreadedServer(served_engine(tiny_checkpoint), ServerConfig("tiny")) as plain:
        assert "spec_decode" not in httpx.get(f"{plain.url}/metrics").text  # vLLM registers them only when on
    engine = served_engine(tiny_checkpoint, "--speculative-config", json.dumps(SERVED_NGRAM))
    with ThreadedServer(engine, ServerConfig("tiny")) as server:
        assert spec_decode_samples(server.url) == {"0": dict.fromkeys(SPEC_DECODE_SAMPLES, 0)}  # every position
        complete_greedily(server.url, PROMPTS)
        counted = engine.engine.stats()["spec_decode"]
        assert spec_decode_samples(server.url) == {"0": expected_samples(counted)}
    assert counted["num_drafts"] > 0 and 0 < counted["num_accepted_tokens"] <= counted["num_draft_tokens"]
    assert sum(counted["num_accepted_tokens_per_pos"]) == counted["num_accepted_tokens"]


def test_the_server_drafts_with_a_draft_model_named_on_the_command_line(tiny_checkpoint, draft_dir):
    """`jax-engine serve --speculative-config '{"model": DIR, ...}'`: the openai client reads the plain server's
    text."""
    texts = {}
    for name, flags in (("plain", ()), ("draft", ("--speculative-config", json.dumps(draft_config(draft_dir))))):
        engine = served_engine(tiny_checkpoint, *flags)
        with ThreadedServer(engine, ServerConfig("tiny")) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            texts[name] = [client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0,
                                                     extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    assert texts["draft"] == texts["plain"]
    assert engine.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_data_parallel_replicas_spec_decode_counters_are_labelled_per_replica(tiny_checkpoint):
    """Each replica's spec-decode counters under its engine label, as the other engine metrics."""
    replicas = [served_engine(tiny_checkpoint, "--speculative-config", json.dumps(SERVED_NGRAM)) for _ in range(2)]
    with ThreadedServer(DataParallelEngine(replicas), ServerConfig("tiny")) as server:
        complete_greedily(server.url, PROMPTS[:2])  # one on each replica
        counted = [replica.engine.stats()["spec_decode"] for replica in replicas]
        assert all(c["num_drafts"] > 0 for c in counted)
        assert spec_decode_samples(server.url) == {str(r): expected_samples(c) for r, c in enumerate(counted)}
