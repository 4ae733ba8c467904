"""Structured output through LLM.generate on the default model: JSON schemas, regexes, choices and grammars
(Lark and GBNF), composed with parallel sampling, preemption (both modes), prefix caching and stop strings,
and the same tokens whether a request runs alone or beside others."""

import json
import re
import time

import jsonschema
import pytest

from jax_engine import SamplingParams
from jax_engine.structured_output import StructuredOutputsParams
from jax_engine.structured_output.worker import COMPILE_TIMEOUT_SECONDS

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "address", "pets"],
    "additionalProperties": False,
}
PROMPT = "A person, as JSON:"


def generate(llm, prompts, max_tokens=120, **fields):
    params = SamplingParams(max_tokens=max_tokens, **fields)
    return llm.generate(prompts, params, use_tqdm=False)


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def test_json_schema_outputs_validate_at_temperature_1(llm):
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs={"json": PERSON})
              for seed in range(6)]
    outputs = llm.generate([PROMPT] * 6, params, use_tqdm=False)
    for completion in (c for o in outputs for c in o.outputs):
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert len(set(texts(outputs))) == 6  # the grammar leaves the model its choices


def test_regex_choice_and_grammars_match(llm):
    [phone] = texts(generate(llm, ["Call me at"], temperature=0, structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"}))
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone)
    choices = ["Paris", "Lyon", "Marseille in the south"]
    [choice] = texts(generate(llm, ["The capital of France is"], temperature=0, structured_outputs={"choice": choices}))
    assert choice == "Paris"
    lark = 'start: "SELECT " column (", " column)* " FROM " table\ncolumn: /[a-z_]{1,10}/\ntable: "users" | "orders"'
    [sql] = texts(generate(llm, ["SQL:"], temperature=0, structured_outputs={"grammar": lark}))
    assert re.fullmatch(r"SELECT [a-z_]{1,10}(, [a-z_]{1,10})* FROM (users|orders)", sql)
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    [answer] = texts(generate(llm, ["What is 6 x 7?"], temperature=0, structured_outputs={"grammar": gbnf}))
    assert re.fullmatch(r"The answer is [0-9]+\.", answer)
    [obj] = texts(generate(llm, [PROMPT], temperature=0, structured_outputs={"json_object": True}))
    assert isinstance(json.loads(obj), dict)


def test_compact_json_has_no_whitespace_between_tokens(llm):
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    [text] = texts(generate(llm, [PROMPT], temperature=0, structured_outputs=params))
    value = json.loads(text)
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_greedy_constrained_output_is_the_same_alone_and_in_a_batch(llm):
    constrained = dict(temperature=0, structured_outputs={"json": PERSON})
    alone = texts(generate(llm, [PROMPT], **constrained))
    others = ["Once upon a time", "def fibonacci(n):", "The capital of France is"]
    other_params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=1.0, seed=1, max_tokens=30)]
    others_alone = [texts(llm.generate([p], [q], use_tqdm=False))[0] for p, q in zip(others, other_params)]
    mixed = llm.generate([*others[:2], PROMPT, others[2]],
                         [*other_params[:2], SamplingParams(max_tokens=120, **constrained), other_params[2]],
                         use_tqdm=False)
    assert texts(mixed[2:3]) == alone
    # and the unconstrained rows beside it are untouched by its mask
    assert texts(mixed[:2]) + texts(mixed[3:]) == others_alone


def test_parallel_samples_each_follow_the_grammar(llm):
    [output] = generate(llm, [PROMPT], n=4, temperature=1.0, seed=3, structured_outputs={"json": PERSON})
    assert len(output.outputs) == 4
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), PERSON)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_the_matcher_survives_preemption(make_llm, llm, preemption_mode):
    """Six requests share 24 blocks of 8 tokens: they preempt one another, and the outputs are those of an
    engine with room for all."""
    prompts = [f"Person number {i}, as JSON:" for i in range(6)]
    fields = dict(temperature=1.0, seed=11, structured_outputs={"json": PERSON})
    expected = texts(generate(llm, prompts, **fields))
    small = make_llm(num_gpu_blocks_override=24, block_size=8, max_model_len=160, max_num_seqs=6,
                     max_num_batched_tokens=64, preemption_mode=preemption_mode, swap_space=1)
    got = texts(generate(small, prompts, **fields))
    assert small.llm_engine.stats()["num_preemptions"] > 0
    assert got == expected
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)


def test_prefix_cache_hits_and_stop_strings(llm):
    fields = dict(temperature=0, structured_outputs={"json": PERSON})
    prompt = "Here is a long shared preamble about people and their pets, written out in JSON form. " * 4 + PROMPT
    first, again = generate(llm, [prompt], 100, **fields), generate(llm, [prompt], 100, **fields)
    assert again[0].num_cached_tokens > 0 and texts(again) == texts(first)
    [cut] = generate(llm, [prompt], 100, stop=['"address"'], **fields)
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == '"address"'
    assert texts(first)[0].startswith(cut.outputs[0].text)


def test_a_grammar_that_cannot_finish_ends_with_length(llm):
    [output] = generate(llm, [PROMPT], max_tokens=5, temperature=0, structured_outputs={"json": PERSON})
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)


def chained_rules(count: int) -> str:
    """A Lark grammar whose rules each refer to the next: the grammar library recurses once per rule."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(count)) + f'r{count}: "y"\n'


def chained_refs(count: int) -> dict:
    """A JSON schema of `count` definitions, each referring to the next."""
    definitions = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(count)}
    return {"$defs": {**definitions, f"d{count}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def nested_arrays(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json is invalid"),
    ({"json": "{not json"}, "structured_outputs.json is invalid"),
    ({"regex": "(unclosed"}, "structured_outputs.regex is invalid"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar is invalid"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs must be exactly one of"),
    ({"choice": []}, "structured_outputs.choice must be a list of 1 to"),
    ({}, "structured_outputs must be exactly one of"),
    ({"choice": ["a", 3]}, "structured_outputs.choice must be a list"),
    ({"regexp": "a"}, "structured_outputs must be a dict with keys among"),
    # Past the limits on a grammar's size and nesting, checked before the grammar library sees it (issue 40):
    ({"grammar": chained_rules(5000)}, "structured_outputs.grammar must be a grammar of at most 1000 rules"),
    ({"json": chained_refs(3000)}, "structured_outputs.json must be a schema with at most 256 $refs"),
    ({"json": nested_arrays(100)}, "structured_outputs.json must be a schema nested at most 64 levels deep"),
    ({"regex": "(x{1000}){1000}"}, "structured_outputs.regex must be nested counted repetitions ({n}) whose "
                                   "product is at most 10000"),
    ({"json": {"type": "string", "pattern": "(ab{200}){200}"}}, "structured_outputs.json pattern must be nested"),
])
def test_bad_constraints_are_refused_before_admission(llm, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(llm, [PROMPT], structured_outputs=fields)
    assert not llm.llm_engine.has_unfinished_requests()
    assert texts(generate(llm, [PROMPT], max_tokens=4, temperature=0))  # still serving


@pytest.mark.parametrize("fields", [
    {"grammar": chained_rules(900)},  # within the rule limit, but it overflows the worker's 1 MiB stack
    # ~2.2x more compile time per pattern: 20 take ~46 s to compile, and are stopped after 5 s
    {"json": {"type": "string", "allOf": [{"pattern": f".*{chr(97 + i)}.*"} for i in range(20)]}},
])
def test_a_grammar_that_crashes_or_runs_away_costs_its_request_alone(llm, fields):
    """Issue 40: such grammars killed the server (SIGSEGV) or froze it for 9-54 s. Compiled in the worker
    process, they cost their request a ValueError after at most the worker's timeout, and the engine serves on."""
    started = time.perf_counter()
    with pytest.raises(ValueError, match="is too costly to compile"):
        generate(llm, [PROMPT], structured_outputs=fields)
    assert time.perf_counter() - started < COMPILE_TIMEOUT_SECONDS + 5
    assert texts(generate(llm, [PROMPT], max_tokens=4, temperature=0, structured_outputs={"regex": "[a-z]{3}"}))


# A grammar that passes the check before admission (compile, first mask) and one of llguidance's limits later.
PAST_LIMITS_MID_OUTPUT = {
    # each token widens the lexer's state: after a dozen, a mask passes the per-step budget (on a slow machine its
    # CPU time may pass MASK_LIMIT_SECONDS first: 29 ms in a CI run where everything ran 1.7x slower)
    "mask": ({"regex": "(.{0,100}a){100}"}, "structured output stopped: (lexer error: too many expressions|a mask "
             r"took \d+ ms of CPU, more than the limit of 20 ms)"),
    # 5000 alternatives open at once after the first "{": a parser row of more than 2,000 items
    "token": ({"json": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                   "required": [f"k{i}"]} for i in range(5000)]}},
              r"the grammar's parser stopped at token \d+, past one of its limits: Parser Error: Current row has 5000"),
    # matching a long literal costs time and no fuel: ~80 ms a mask, where ordinary grammars take under 1 ms
    "time": ({"json": {"const": "z" * 300_000}},
             r"structured output stopped: a mask took \d+ ms of CPU, more than the limit of 20 ms"),
}


@pytest.mark.parametrize("where", PAST_LIMITS_MID_OUTPUT)
def test_a_matcher_past_its_limits_ends_its_request_alone_and_says_why(llm, where):
    """Such a request ends with finish_reason "error", its stop_reason says why (a server turns it into a 400
    naming the field), and the request beside it finishes as it would alone. Where: the grammar's mask passes the
    library's per-step budget, consuming a token the mask allowed passes its parser's row limit, or a mask takes
    longer than MASK_LIMIT_SECONDS."""
    structured_outputs, reason = PAST_LIMITS_MID_OUTPUT[where]
    bystander = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = llm.generate([PROMPT], bystander, use_tqdm=False)[0].outputs[0].token_ids
    costly = SamplingParams(temperature=1.0, seed=0, max_tokens=100, structured_outputs=structured_outputs)
    failed, beside = llm.generate([PROMPT, PROMPT], [costly, bystander], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error" and len(failed.outputs[0].token_ids) < 100
    assert re.match(reason, failed.outputs[0].stop_reason), failed.outputs[0].stop_reason
    assert beside.outputs[0].token_ids == alone


def test_a_token_its_grammar_rejects_ends_that_sequence_alone(llm, caplog):
    """The scheduler appends tokens and advances grammars (update_from_output). A token the matcher refuses
    (the mask makes this a bug, not a client's doing) ends that sequence with FINISHED_ERROR and frees its
    blocks; the sequence beside it takes its token as usual."""
    from jax_engine.core.kv_cache_manager import CacheConfig
    from jax_engine.core.scheduler import Scheduler
    from jax_engine.sample.sampler import SampledToken
    from reference.request import RequestStatus
    from tests.engine_helpers import sequence

    engine = llm.llm_engine
    compiler = engine.grammar_compiler
    scheduler = Scheduler(engine.scheduler_config, CacheConfig(num_blocks=8, block_size=16))
    constrained, bystander = sequence("constrained", [1, 2, 3]), sequence("bystander", [1, 2, 3])
    constrained.grammar = compiler.matcher(compiler.compile(StructuredOutputsParams(regex="[a-z]{3}")))
    digit = engine.tokenizer.encode("7", add_special_tokens=False)[0]
    for seq in (constrained, bystander):
        scheduler.add_request([seq])
    out = scheduler.schedule()
    sampled = [(seq, SampledToken(digit, 0.0, 1, [], [])) for seq in (constrained, bystander)]
    with caplog.at_level("ERROR", logger="jax_engine"):
        appended = scheduler.update_from_output(out, sampled)
    assert [seq for seq, _ in appended] == [constrained, bystander]
    assert constrained.status is RequestStatus.FINISHED_ERROR and "the grammar rejected token" in caplog.text
    assert constrained.stop_reason is None  # the engine's fault, not the request's: no reason for the client
    assert bystander.status is RequestStatus.RUNNING and bystander.output_token_ids == [digit]
    assert scheduler.block_stats().num_free_blocks == 8 - 1  # the bystander's one block
