"""What a checkpoint directory says beyond its weights: generation_config.json's sampling defaults and
end-of-sequence ids, and its chat template, rendered and tokenized once (vLLM's rules)."""

import json

import openai
import pytest

from jax_engine import LLM, SamplingParams
from jax_engine.beam_search import BeamSearchParams
from jax_engine.chat_template import chat_prompt
from jax_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server_helpers import TINY_ENGINE_ARGS, ThreadedServer
from tests.tiny_checkpoints import make_tiny_checkpoint

BOS = 258  # the BOS-adding tokenizer's <s>
GENERATION_CONFIG = {"temperature": 0.0, "top_k": 20, "max_new_tokens": 5, "repetition_penalty": 1.3,
                     "do_sample": True, "eos_token_id": [257, 42]}
CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A tiny Llama whose tokenizer adds a BOS, with a generation config."""
    directory = tmp_path_factory.mktemp("generation-config")
    make_tiny_checkpoint(directory, "llama", adds_bos=True, vocab_size=259)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return directory


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(str(checkpoint_dir), **TINY_ENGINE_ARGS)


def test_generation_config_sets_the_default_sampling_params(llm):
    expected = SamplingParams(temperature=0.0, top_k=20, max_tokens=5, repetition_penalty=1.3)
    assert llm.get_default_sampling_params() == expected
    [default] = llm.generate("Hello", use_tqdm=False)
    [explicit] = llm.generate("Hello", expected, use_tqdm=False)
    assert len(default.outputs[0].token_ids) == 5
    assert default.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert llm.llm_engine.eos_token_ids == (257, 42)


def test_generation_config_vllm_or_another_directory(checkpoint_dir, tmp_path):
    args = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 16}
    neutral = LLM(str(checkpoint_dir), generation_config="vllm", **args)
    assert neutral.get_default_sampling_params() == SamplingParams()
    assert neutral.llm_engine.eos_token_ids == (257, 42)  # end-of-sequence ids apply whatever the choice
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "eos_token_id": 7}))
    other = LLM(str(checkpoint_dir), generation_config=str(tmp_path), **args)
    assert other.get_default_sampling_params() == SamplingParams(top_p=0.5)
    assert other.llm_engine.eos_token_ids == (257, 7)
    with pytest.raises(FileNotFoundError, match="generation_config='/nowhere'"):
        LLM(str(checkpoint_dir), generation_config="/nowhere", **args)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="generation config's sampling defaults: top_p"):
        LLM(str(checkpoint_dir), generation_config=str(tmp_path), **args)


def test_request_fields_win_over_the_generation_config_on_the_server():
    defaults = {"temperature": 0.0, "top_k": 20, "max_tokens": 5}
    params = CompletionRequest(prompt="x", temperature=0.7, max_tokens=3).sampling_params(3, None, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 20, 3)
    chat = ChatCompletionRequest(messages=CHAT).sampling_params(None, None, defaults)
    assert (chat.temperature, chat.top_p, chat.max_tokens) == (0.0, 1.0, 5)  # max_new_tokens caps max_tokens


def test_beam_search_takes_the_generation_configs_max_tokens_but_not_its_temperature():
    """Beams rank by the model's log-probabilities: a generation config's temperature would refuse every
    use_beam_search request of a model that sets one (0.6, say), so only its max_tokens applies."""
    defaults = {"temperature": 0.6, "max_tokens": 5}
    body = CompletionRequest(prompt="x", use_beam_search=True, n=3, length_penalty=0.5, ignore_eos=True)
    assert body.beam_search_params(None, defaults) == BeamSearchParams(3, 5, ignore_eos=True, length_penalty=0.5)
    assert body.beam_search_params(4, defaults).max_tokens == 4


def test_a_chat_prompt_holds_one_bos(llm):
    """The template writes the BOS; encoding the rendered text as a plain prompt would add a second."""
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<s>") and tokenizer.encode(text)[:2] == [BOS, BOS]
    [output] = llm.chat(CHAT, use_tqdm=False)
    assert output.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert output.prompt_token_ids.count(BOS) == 1 and output.prompt == text


def test_the_server_applies_both(llm):
    """Over HTTP with the openai client: one BOS in the chat prompt, max_new_tokens capping the reply."""
    from jax_engine.async_llm_engine import AsyncLLMEngine
    from jax_engine.server.server_config import ServerConfig

    with ThreadedServer(AsyncLLMEngine(llm.llm_engine), ServerConfig(model_name="tiny")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=CHAT)
    expected = chat_prompt(llm.get_tokenizer(), CHAT)["prompt_token_ids"]
    assert reply.usage.prompt_tokens == len(expected) and expected.count(BOS) == 1
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"


def test_override_generation_config_goes_on_top_of_the_choice(checkpoint_dir):
    """vLLM's override_generation_config (--override-generation-config JSON): merged into the model's defaults under
    "auto", the only defaults under "vllm"; a name it does not know, or a value SamplingParams refuses, is an
    error naming it before anything loads."""
    import argparse

    from jax_engine import EngineArgs

    args = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 16}
    merged = LLM(str(checkpoint_dir), override_generation_config={"max_new_tokens": 3, "top_p": 0.5}, **args)
    assert merged.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=20, max_tokens=3,
                                                                   repetition_penalty=1.3, top_p=0.5)
    [output] = merged.generate("Hello", use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3
    alone = LLM(str(checkpoint_dir), generation_config="vllm", override_generation_config={"temperature": 0.5},
                **args)
    assert alone.get_default_sampling_params() == SamplingParams(temperature=0.5)
    for overrides, message in (({"do_sample": True}, "override_generation_config must be None or a dict of"),
                               ({"top_p": 1.5}, "override_generation_config: top_p"), ([1], "a dict of")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(str(checkpoint_dir), override_generation_config=overrides)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(["--override-generation-config", '{"max_new_tokens": 2}']))
    assert parsed.override_generation_config == {"max_new_tokens": 2}
