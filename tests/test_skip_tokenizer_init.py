"""The tokenizer a model runs with, vLLM's two switches: skip_tokenizer_init (token ids in and token ids out, for a
checkpoint without tokenizer files, which is otherwise refused when it loads, naming the flag), and tokenizer
(another directory's tokenizer instead of the model's own)."""

import pytest

from jax_engine import LLM, EngineArgs, LLMEngine, SamplingParams

ARGS = dict(num_gpu_blocks_override=32, block_size=8, max_model_len=64, max_num_seqs=4, enforce_eager=True)
PROMPTS = [[5, 17, 42, 99, 3], [100, 101, 102]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def test_a_checkpoint_without_a_tokenizer_is_refused_at_load(bare_checkpoint_dir):
    with pytest.raises(ValueError, match="has no tokenizer.*skip_tokenizer_init=True"):
        LLM(str(bare_checkpoint_dir), **ARGS)


def test_token_ids_in_and_out(bare_checkpoint_dir, tiny_checkpoint):
    """The same tokens as an engine with the tokenizer, no text; what needs text is refused naming its field."""
    bare = LLM(str(bare_checkpoint_dir), skip_tokenizer_init=True, **ARGS)
    assert bare.get_tokenizer() is None
    outputs = bare.generate(PROMPTS, GREEDY, use_tqdm=False)
    with_tokenizer = LLM.from_engine(LLMEngine(EngineArgs(**ARGS), checkpoint=tiny_checkpoint))
    expected = with_tokenizer.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert all(o.outputs[0].text == "" and len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert {lp.decoded_token for o in outputs for entry in o.outputs[0].logprobs for lp in entry.values()} == {None}
    refused = [("prompt must be token ids", "some text", GREEDY),
               ("stop needs the tokenizer", PROMPTS[0], SamplingParams(stop=["x"])),
               ("bad_words needs the tokenizer", PROMPTS[0], SamplingParams(bad_words=["x"])),
               ("structured_outputs needs the tokenizer", PROMPTS[0],
                SamplingParams(structured_outputs={"choice": ["a", "b"]}))]
    for message, prompt, params in refused:
        with pytest.raises(ValueError, match=message):
            bare.generate([prompt], params, use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs the model's chat template"):
        bare.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert bare.llm_engine.scheduler.kv.usage == 0  # nothing refused kept a block


def test_another_directorys_tokenizer_runs_the_model(bare_checkpoint_dir, tiny_checkpoint_dir, tiny_checkpoint,
                                                     tmp_path):
    """tokenizer= gives a checkpoint shipped without one the tokenizer (and chat template) of a directory: text in,
    text out, the same as the model with its own. A directory without one, one too large for the model, or the
    argument beside skip_tokenizer_init is refused, naming it."""
    llm = LLM(str(bare_checkpoint_dir), tokenizer=tiny_checkpoint_dir, **ARGS)
    chat = [{"role": "user", "content": "Hi"}]
    with_own = LLM.from_engine(LLMEngine(EngineArgs(**ARGS), checkpoint=tiny_checkpoint))
    for run in (lambda m: m.generate(["some text"], GREEDY, use_tqdm=False),
                lambda m: m.chat(chat, GREEDY, use_tqdm=False)):
        [got], [expected] = run(llm), run(with_own)
        assert got.prompt_token_ids == expected.prompt_token_ids and got.outputs[0].text == expected.outputs[0].text
        assert len(got.outputs[0].text) > 0
    with pytest.raises(ValueError, match="tokenizer=.* is not a directory holding tokenizer files"):
        LLM(str(bare_checkpoint_dir), tokenizer=str(tmp_path), **ARGS)
    from transformers import AutoTokenizer

    larger = AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    larger.add_tokens(["<extra>"])  # 259 tokens for a model of 258
    larger.save_pretrained(tmp_path / "larger")
    with pytest.raises(ValueError, match="259 tokens, more than the model's vocab_size 258"):
        LLM(str(bare_checkpoint_dir), tokenizer=str(tmp_path / "larger"), **ARGS)
    with pytest.raises(ValueError, match="tokenizer must be None with skip_tokenizer_init=True"):
        EngineArgs(tokenizer=tiny_checkpoint_dir, skip_tokenizer_init=True)
