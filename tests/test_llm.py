"""LLM().generate on the real default model: the oracle, HF, invariance, and vLLM's API surface."""

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine import LLM, EngineArgs, SamplingParams
from jax_engine.attention import get_attention_backend
from jax_engine.attention.backend import CPU, XLA
from jax_engine.attention.cpu import kernel_unavailable_reason
from jax_engine.kv_cache_plan import resolve_block_size
from jax_engine.linear.matmul import MANY_ROWS_KERNEL
from jax_engine.linear.matmul import kernel_unavailable_reason as matmul_kernel_unavailable
from jax_engine.models.layers import normalize
from reference import LlamaModel, ReferenceEngine
from reference import SamplingParams as ReferenceSamplingParams
from tests.quick_compiles import users_compiled_text
from tests.tiny_checkpoints import CHAT_TEMPLATE

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a little robot"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_greedy_tokens_equal_the_reference_engine(llm, default_checkpoint):
    reference = ReferenceEngine(LlamaModel(default_checkpoint.config, default_checkpoint.weights), num_blocks=64,
                                tokenizer=default_checkpoint.tokenizer)
    expected = reference.generate(PROMPTS, ReferenceSamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [g.output_token_ids for g in expected]
    assert [o.outputs[0].text for o in outputs] == [g.text for g in expected]


def test_chat_knows_the_capital_of_france(llm):
    [output] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in output.outputs[0].text and output.outputs[0].finish_reason == "stop"


def test_chat_template_kwargs_are_template_variables(llm, tiny_checkpoint):
    """Qwen3's enable_thinking switch (the tiny template has it) through chat_prompt, which LLM.chat and the server
    call; apply_chat_template's own arguments are refused naming the field, before anything runs."""
    from jax_engine.chat_template import chat_prompt

    conversation = [{"role": "user", "content": "Hi"}]
    default, off = (chat_prompt(tiny_checkpoint.tokenizer, conversation, chat_template_kwargs=kwargs)["prompt"]
                    for kwargs in (None, {"enable_thinking": False}))
    assert off == default + "<think>\n\n</think>\n\n"
    for kwargs, message in (({"tokenize": True}, "may not set 'tokenize'"), ([1], "a dict with string keys")):
        with pytest.raises(ValueError, match=f"chat_template_kwargs.*{message}"):
            llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)
    [output] = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert output.prompt.endswith("<|im_start|>assistant\n")  # SmolLM2's template reads no such variable


def test_chat_takes_a_template_and_continues_a_final_message(llm, tiny_checkpoint):
    """vLLM's LLM.chat arguments: chat_template renders instead of the model's own (which a base model may lack:
    then a clear error says how to give one), tools reach it; continue_final_message leaves the last message open
    for the model to finish, and cannot go with add_generation_prompt."""
    from jax_engine.chat_template import chat_prompt

    question = [{"role": "user", "content": "What is the capital of France?"}]
    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    [custom] = llm.chat(question, GREEDY, use_tqdm=False, chat_template=template)
    assert custom.prompt == "Q: What is the capital of France?\nA:"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    [shown] = llm.chat(question, SamplingParams(max_tokens=1), use_tqdm=False, tools=[tool],
                       chat_template="{% for t in tools %}{{ t['function']['name'] }};{% endfor %}")
    assert shown.prompt == "get_weather;"  # tools reach the template, as vLLM passes them
    started = [*question, {"role": "assistant", "content": "The capital of France is"}]
    [continued] = llm.chat(started, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                           add_generation_prompt=False, continue_final_message=True)
    assert continued.prompt.endswith("<|im_start|>assistant\nThe capital of France is")  # no <|im_end|>
    assert "Paris" in continued.outputs[0].text
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt cannot both be true"):
        llm.chat(started, GREEDY, use_tqdm=False, continue_final_message=True)
    base = copy.copy(tiny_checkpoint.tokenizer)
    base.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*chat_template"):
        chat_prompt(base, question)
    assert chat_prompt(base, question, chat_template=CHAT_TEMPLATE) == chat_prompt(tiny_checkpoint.tokenizer, question)


def test_chat_content_parts_reach_the_template_in_the_form_it_reads(llm):
    """vLLM's chat_template_content_format: SmolLM2's template prints a message's content, so "auto" joins its text
    parts with newlines; a template that loops over the parts gets a list (a string content as one part); a part
    that is no text is refused naming it, before anything runs."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    one_token = SamplingParams(max_tokens=1)
    [from_parts], [from_text] = (llm.chat(m, one_token, use_tqdm=False) for m in (
        parts, [{"role": "user", "content": "What is the capital\nof France?"}]))
    assert from_parts.prompt == from_text.prompt and "capital\nof France?<|im_end|>" in from_parts.prompt
    loop = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"
    [looped] = llm.chat([*parts, {"role": "user", "content": "Paris?"}], one_token, use_tqdm=False, chat_template=loop)
    assert looped.prompt == "[What is the capital][of France?][Paris?]"
    [joined] = llm.chat(parts, one_token, use_tqdm=False, chat_template="{{ messages[0]['content'] }}|",
                        chat_template_content_format="string")
    assert joined.prompt == "What is the capital\nof France?|"
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\] must be .*no images.*got 'image_url'"):
        llm.chat([{"role": "user", "content": [parts[0]["content"][0], image]}], one_token, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        llm.chat(parts, one_token, use_tqdm=False, chat_template_content_format="text")
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_params_clone_is_deep():
    """vLLM's clone: an equal copy whose dicts are its own (the other fields are stored as tuples already)."""
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}, allowed_token_ids=[1, 2, 3],
                            structured_outputs={"choice": ["a", "b"]})
    copy = params.clone()
    assert copy == params and copy is not params and copy.logit_bias is not params.logit_bias
    copy.logit_bias[4] = 2.0
    assert params.logit_bias == {3: 1.0}


def test_outputs_do_not_depend_on_the_rest_of_the_batch(llm):
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=20, seed=5, max_tokens=12, ignore_eos=True)]
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, p, batched in zip(PROMPTS, params, together):
        [alone] = llm.generate(prompt, p, use_tqdm=False)
        assert alone.outputs[0].token_ids == batched.outputs[0].token_ids


def test_greedy_continuations_equal_hf_generate(llm, default_checkpoint):
    import torch

    from jax_engine.bench.hf_baseline import hf_model_from_checkpoint

    hf = hf_model_from_checkpoint(default_checkpoint)
    tokenizer = default_checkpoint.tokenizer
    ours = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, ours):
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            expected = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert output.outputs[0].token_ids == expected[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_tiny_checkpoints_greedy_equals_hf_generate(tmp_path, architecture):
    import torch

    from tests.tiny_checkpoints import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path, architecture)
    llm = LLM(str(tmp_path), num_gpu_blocks_override=32, block_size=8, max_model_len=64, max_num_seqs=4,
              enforce_eager=True)
    prompts = [[256, 5, 6, 7], [256, 100, 101, 102, 103, 104, 105, 106, 107, 108]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_prompt_forms_and_request_output_fields(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[0])
    from_text, from_ids, from_dict = llm.generate([PROMPTS[0], ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert from_text.prompt == PROMPTS[0] and from_ids.prompt is None
    assert from_text.prompt_token_ids == from_ids.prompt_token_ids == ids
    assert from_text.outputs[0].token_ids == from_ids.outputs[0].token_ids == from_dict.outputs[0].token_ids
    assert from_text.finished and from_text.outputs[0].finish_reason == "length" and len(from_text.outputs[0].token_ids) == 12
    [single] = llm.generate(ids, GREEDY, use_tqdm=False)  # one token-id list is one prompt
    assert single.outputs[0].token_ids == from_ids.outputs[0].token_ids
    assert single.metrics.first_token_time >= single.metrics.arrival_time


def test_n_completions_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=6, logprobs=5, ignore_eos=True)
    [output] = llm.generate(PROMPTS[2], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # seeds 0, 1, 2 differ
    for completion in output.outputs:
        assert len(completion.logprobs) == 6
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and 5 <= len(entry) <= 6
            assert sorted(lp.rank for t, lp in entry.items() if t != token or lp.rank <= 5)[:5] == [1, 2, 3, 4, 5]
            top = max(entry.values(), key=lambda lp: lp.logprob)
            assert top.rank == 1 and all(lp.logprob <= 0 for lp in entry.values())
        chosen = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        # The engine sums float32 logprobs as they come; Python sums the reported ones in float64.
        assert completion.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)


def test_prompt_logprobs_match_the_generated_logprobs_of_a_greedy_run(llm):
    [first] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True),
                           use_tqdm=False)
    full = first.prompt_token_ids + first.outputs[0].token_ids
    [rescored] = llm.generate([full], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    assert rescored.prompt_logprobs[0] is None and len(rescored.prompt_logprobs) == len(full)
    n = len(first.prompt_token_ids)
    for i, token in enumerate(first.outputs[0].token_ids):  # scoring the text again gives the same numbers
        scored = rescored.prompt_logprobs[n + i][token]
        # The same float32 model in another batch layout (one prefill instead of decode steps): logits agree to
        # ~1e-4 (test_engine_model_vs_hf.py), so log-softmaxes of them to a few times that.
        assert scored.rank == 1 and scored.logprob == pytest.approx(first.outputs[0].logprobs[i][token].logprob, abs=1e-3)


def test_stop_strings_stop_tokens_and_min_tokens(llm):
    [free] = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    text, tokens = free.outputs[0].text, free.outputs[0].token_ids
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    [cut] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)
    assert cut.outputs[0].text == text[: text.index(stop)] and cut.outputs[0].stop_reason == stop
    [kept] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop=stop,
                                                     include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    [by_id] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[3]]),
                           use_tqdm=False)
    assert by_id.outputs[0].token_ids == tokens[: tokens.index(tokens[3]) + 1] and by_id.outputs[0].stop_reason == tokens[3]
    [late] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[0]],
                                                     min_tokens=2), use_tqdm=False)
    assert tokens[0] not in late.outputs[0].token_ids[:2] and len(late.outputs[0].token_ids) >= 2
    # vLLM's rules for stop strings: none before min_tokens; the token that reaches max_tokens is searched too.
    [waited] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop=[stop], min_tokens=12),
                            use_tqdm=False)
    assert (waited.outputs[0].text, waited.outputs[0].finish_reason) == (text, "length")
    last = next(text[-k:] for k in range(3, len(text)) if text.index(text[-k:]) == len(text) - k)
    [at_max] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop=[last]), use_tqdm=False)
    completion = at_max.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (text[: -len(last)], "stop", last)
    assert completion.token_ids == tokens


def test_eos_ends_a_chat_unless_ignored(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    [ended] = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert ended.outputs[0].finish_reason == "stop" and ended.outputs[0].stop_reason is None
    assert ended.outputs[0].token_ids[-1] == 2  # <|im_end|>, kept in token_ids, skipped in text
    assert "<|im_end|>" not in ended.outputs[0].text


def test_abort_frees_every_block(llm):
    engine = llm.llm_engine
    total = engine.scheduler.kv.device.num_blocks
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(["abort-0", "abort-1", "abort-2"])
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["abort-0", "abort-1", "abort-2"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outputs)
    assert not engine.has_unfinished_requests() and engine.scheduler.kv.device.num_free_blocks == total


def test_bad_input_is_a_clear_value_error(llm):
    cases = [
        ([""], "prompt must not be empty"),
        ([[1, 49152]], r"\[0, vocab_size=49152\)"),
        ([[-1]], r"\[0, vocab_size=49152\)"),
        (["word " * 300], "exceeds max_model_len=256"),
        ([3.5], "prompt must be a string or a list of token ids"),
    ]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds max_model_len=256"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=300), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing half-added is left behind


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=float("nan")), r"temperature must be a number in \[0, 3.40282e\+38\], got nan"),
    (dict(top_p=0), r"top_p must be a number in \(0, 1\]"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\] or None"),
    (dict(prompt_logprobs=-1), r"prompt_logprobs must be an integer in \[0, 20\] or None"),
    (dict(presence_penalty=3), r"presence_penalty must be a number in \[-2, 2\]"),
    (dict(repetition_penalty=0), r"repetition_penalty must be a number in \[0.01, 100\]"),
    (dict(min_tokens=5, max_tokens=4), r"min_tokens must be <= max_tokens \(4\)"),
    (dict(stop=[""]), "stop must be a string or a list of at most 64 non-empty strings"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(preemption_mode="drop"), "preemption_mode must be one of"),
    (dict(attention_backend="cuda"), "attention_backend must be one of"),
    (dict(dtype="int4"), "dtype must be"),
    (dict(kv_cache_dtype="int8"),
     r"kv_cache_dtype must be one of \['auto', 'bfloat16', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\], got 'int8'"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(enable_lora=True, nnodes=2), r"enable_lora is not supported yet with nnodes > 1"),
    (dict(enable_lora=True, speculative_config={"model": "self", "num_speculative_tokens": 2}),
     r"enable_lora is not supported yet with .* a draft model"),
    (dict(scheduling_policy="lifo"), r"scheduling_policy must be one of \('fcfs', 'priority'\)"),
    (dict(tokenizer_mode="mistral"), r"tokenizer_mode must be one of \('auto', 'hf'\) \(a fast tokenizer\)"),
    (dict(load_format="pt"), r"load_format must be one of \('auto', 'safetensors', 'gguf'\), got 'pt'"),
])
def test_bad_engine_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_unknown_engine_argument_and_too_small_cache():
    with pytest.raises(ValueError, match="unknown engine arguments: \\['max_batch'\\]"):
        LLM(max_batch=3)
    with pytest.raises(ValueError, match=r"holds 240 tokens \(15 blocks of 16\) but max_model_len is 256"):
        LLM(num_gpu_blocks_override=15, block_size=16, max_model_len=256)


def test_block_size_defaults_to_the_attention_backends(llm):
    pallas = get_attention_backend("pallas", "cpu")
    assert resolve_block_size(None, CPU) == 64  # the cpu kernel streams blocks: bigger ones read faster
    assert resolve_block_size(None, XLA) == resolve_block_size(None, pallas) == 16  # vLLM's GPU default
    assert resolve_block_size(8, CPU) == 8
    engine = llm.llm_engine
    assert engine.scheduler.kv.block_size == resolve_block_size(None, engine.attention_backend)


def test_steady_state_never_recompiles(llm):
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    before = llm.llm_engine.runner.programs.num_late_compiles
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.llm_engine.runner.programs.num_late_compiles == before


# Tests of what the CPU default (the ragged `cpu` attention backend) does; elsewhere the default is another.
ON_THE_CPU_DEFAULT = pytest.mark.skipif(
    jax.default_backend() != "cpu" or kernel_unavailable_reason() is not None,
    reason="the default attention backend here is not the ragged cpu kernel (no CPU, or no C++ compiler)")


@ON_THE_CPU_DEFAULT
def test_how_prompts_split_a_token_bucket_compiles_nothing_new(llm):
    """The CPU default attends ragged rows: one 31-token prompt, 10 + 20 tokens, or six of 5 are one shape
    (32 tokens, 8 sequence rows); on the padded layout they would be three ([1, 32], [2, 32], [8, 8])."""
    assert llm.llm_engine.attention_backend.name == "cpu" and llm.llm_engine.attention_backend.ragged
    one_token = SamplingParams(temperature=0, max_tokens=1)
    prompts = lambda lengths: [list(range(1000 + 100 * i, 1000 + 100 * i + n)) for i, n in enumerate(lengths)]  # noqa: E731
    step_programs = lambda: {key for key in llm.llm_engine.runner.programs.late if key[0] == "step"}  # noqa: E731
    llm.generate(prompts([31]), one_token, use_tqdm=False)
    before = step_programs()
    for lengths in ([10, 20], [5] * 6):
        outputs = llm.generate(prompts(lengths), one_token, use_tqdm=False)
        assert [len(o.prompt_token_ids) for o in outputs] == lengths
    assert step_programs() == before


@ON_THE_CPU_DEFAULT
def test_sequence_rows_are_bucketed_as_finely_as_tokens(make_llm):
    """72 one-token prompts run as 80 tokens and table rows (quarters of a power of two), not the next power of
    two (128); the step's shapes follow from its token bucket alone (one compile per bucket), the sampling rows
    are picked from max_num_seqs."""
    engine = make_llm(num_gpu_blocks_override=80, max_model_len=128, max_num_seqs=80).llm_engine
    assert engine.attention_backend.ragged
    for i in range(72):
        engine.add_request(str(i), [1000 + i], SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    inputs = engine.runner.prepare(out)
    assert inputs.token_ids.shape == (80,) and inputs.logits_indices.shape == (80,)
    assert inputs.metadata.block_tables.shape[0] == 80 and list(inputs.logits_indices[:72]) == list(range(72))
    engine.abort_request([str(i) for i in range(72)])
    assert engine.scheduler.kv.device.num_free_blocks == 80


def test_decode_steps_reuse_the_memory_of_their_logits(llm):
    """The logits and the sampler's scratch are written into recycled buffers, not fresh ones every step."""
    engine = llm.llm_engine
    engine.add_request("recycled", "The capital of France is", SamplingParams(temperature=1.0, seed=0, max_tokens=6))
    pointers = []
    while engine.has_unfinished_requests():
        engine.step()
        pointers.append(sorted(b.unsafe_buffer_pointer() for b in engine.runner.recycled.free))
    assert len(pointers[1]) == 2 and pointers[1:] == [pointers[1]] * (len(pointers) - 1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA:CPU's compiled HLO; GPU compiles fuse otherwise")
def test_a_small_step_reads_every_layers_weights_in_place(llm, monkeypatch):
    """A decode step of a few rows copies no weight matrix out of the stacked layers: the few-rows kernel takes
    the whole stack and the layer index. (XLA's dot, for more rows of other weight types, reads a sliced copy.)
    Slicing out each layer's matrices would add a copy of the model's weights to a step that only reads them."""
    from jax_engine.runner.device_programs import STEP

    runner = llm.llm_engine.runner
    seen = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda inputs: seen.append(inputs) or execute(inputs))
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=1), use_tqdm=False)
    inputs = seen[0]
    step = users_compiled_text(STEP.fn.lower(runner.flat_model, runner.k_cache, runner.v_cache, inputs.token_ids,
                                             inputs.lora_slots, inputs.metadata, inputs.logits_indices,
                                             runner.backend.attend))
    sliced = re.findall(r"= \w+\[([0-9,]*)\]\{[0-9,]*\} dynamic-slice\(", step)
    matrices = [shape for shape in sliced if sum(int(d) > 1 for d in shape.split(",")) > 1]
    assert "ENTRY" in step and "jax_engine_few_rows_matmul" in step and sliced and not matrices


@pytest.mark.skipif(matmul_kernel_unavailable() is not None, reason=f"no matmul kernel: {matmul_kernel_unavailable()}")
def test_the_padding_rows_of_a_step_skip_every_layer(llm, monkeypatch):
    """A step's token bucket pads its rows (a prompt of 5 tokens runs as 8); the projections multiply only the
    rows before query_start_loc's end, so a padding row leaves the layers as it entered them, the embedding of
    token 0, and comes out as its final norm. Multiplied, it would have come out as the model's output there."""
    runner = llm.llm_engine.runner
    seen = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda inputs: seen.append((inputs, execute(inputs))) or seen[-1][1])
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=1), use_tqdm=False)
    inputs, (_, hidden) = seen[0]
    live, padded = int(inputs.metadata.query_start_loc[-1]), len(inputs.token_ids)
    assert 0 < live < padded and not inputs.token_ids[live:].any()
    top, cfg = runner.model.top, runner.model.cfg
    untouched = normalize(cfg, top["embed"][...][0], top["final_norm"][...])
    np.testing.assert_allclose(np.asarray(hidden)[live:], np.tile(untouched, (padded - live, 1)), atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA:CPU's compiled HLO; GPU compiles fuse otherwise")
@pytest.mark.skipif(not MANY_ROWS_KERNEL, reason="stacks take the kernel past its streamed rows with AVX-512")
@pytest.mark.parametrize("quantization", [None, "bf16", "int8"])
def test_a_large_step_reads_every_layers_weights_in_place(llm, make_llm, quantization):
    """A step of 128 tokens, past the rows the few-rows kernel streams, copies no weight matrix out of the stack
    either (nor widens one: bf16, int8): layers of a stack take the kernel for any rows (matmul.MANY_ROWS_KERNEL)."""
    from jax_engine.runner.device_programs import STEP, step_example

    runner = (make_llm(quantization=quantization) if quantization else llm).llm_engine.runner
    stored = {None: jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}[quantization]
    assert runner.model.layers["w_qkv"].value.dtype == stored
    step = users_compiled_text(STEP.fn.lower(*step_example(runner, 128).args, runner.backend.attend))
    sliced = re.findall(r"= \w+\[([0-9,]*)\]\{[0-9,]*\} dynamic-slice\(", step)
    matrices = [shape for shape in sliced if sum(int(d) > 1 for d in shape.split(",")) > 1]
    assert "jax_engine_few_rows_matmul" in step and sliced and not matrices


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA:CPU's compiled HLO")
@pytest.mark.parametrize("num_tokens", [1, 2])
def test_a_step_updates_the_kv_cache_in_place(llm, num_tokens):
    """No step copies the cache or rewrites it whole. A one-token step's scatter became a dynamic-update-slice
    that XLA:CPU did not do in place: every layer rewrote the whole cache (2 s a step with a 1 GB cache)."""
    from jax_engine.runner.device_programs import STEP, step_example

    runner = llm.llm_engine.runner
    cache = runner.k_cache
    flat = f"f32[{cache.shape[0]},{cache.shape[1] * cache.shape[2]},{cache.shape[3]},{cache.shape[4]}]"
    step = users_compiled_text(STEP.fn.lower(*step_example(runner, num_tokens).args, runner.backend.attend))
    whole_cache = re.compile(re.escape(flat) + r"\{[0-9,]*\} (copy|dynamic-update-slice)\(")
    assert "ENTRY" in step and not whole_cache.search(step)


def test_progress_bar_reports_speeds(llm, capsys):
    llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "est. speed input:" in err and "output:" in err
