"""skip_tokenizer_init (vLLM's): token ids in and token ids out, for a checkpoint without tokenizer files; and
without the flag, such a checkpoint is refused when it loads, naming the flag."""

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
