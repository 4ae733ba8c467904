"""Embeddings (task="embed"): each prompt's pooled final hidden states, against HF transformers' own
(`output_hidden_states`, whose last entry is after the final norm), through LLM.embed and through /v1/embeddings
with the official openai client."""

import numpy as np
import openai
import pytest

from jax_engine import LLM, EngineArgs, PoolingParams, SamplingParams
from tests.server_helpers import TINY_ENGINE_ARGS, cli_flags, start_server_process, stop_server_process
from tests.tiny_checkpoints import hf_vector, make_tiny_checkpoint

# Long enough for several blocks of 4 and, at 16 tokens a step, for prompts computed over several steps.
PROMPTS = [list(range(3, 43)), list(range(60, 71)), [7, 8, 9], list(range(100, 150))]
SMALL_STEPS = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4, "enforce_eager": True}


@pytest.mark.parametrize("architecture", ["llama", "gpt2", "bloom"])
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_embeddings_equal_hf_hidden_states(tmp_path, architecture, pooling):
    """RoPE, learned positions and ALiBi families, prompts split over steps (chunked prefill, 16 tokens a step)."""
    hf_model = make_tiny_checkpoint(tmp_path, architecture)
    llm = LLM(str(tmp_path), task="embed", pooler_config={"pooling_type": pooling}, **SMALL_STEPS)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    diffs = [np.abs(np.asarray(o.outputs.embedding) - hf_vector(hf_model, p, pooling)).max()
             for p, o in zip(PROMPTS, outputs)]
    print(f"{architecture} {pooling}: max |embedding diff| vs HF = {max(diffs):.1e}")
    assert max(diffs) < 1e-5  # float32 sums in another order: ~1e-7 seen
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert outputs[0].outputs.hidden_size == hf_model.config.hidden_size
    # Not normalized, first 8 values (Matryoshka): hidden states of magnitude ~1-3 here, so the same bound.
    raw = llm.encode(PROMPTS[0], PoolingParams(normalize=False, dimensions=8), use_tqdm=False)[0].outputs.data
    expected = hf_vector(hf_model, PROMPTS[0], pooling, normalize=False)[:8]
    assert raw.shape == (8,) and np.abs(raw - expected).max() < 1e-5


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    return str(directory), make_tiny_checkpoint(directory, "llama")


def test_last_pooling_reads_the_prefix_cache_and_mean_pooling_turns_it_off(tiny_llama):
    """LAST needs the prompt's last token alone, which a step always computes: a prompt seen before reads its
    cached blocks and pools the same. MEAN needs every token's row, so its engine has no prefix cache."""
    directory, hf_model = tiny_llama
    llm = LLM(directory, task="embed", **SMALL_STEPS)
    first, again = (llm.encode(PROMPTS[3], use_tqdm=False)[0].outputs.data for _ in range(2))
    assert llm.llm_engine.stats()["prefix_cache_hits"] >= 40  # 10 of its 12 full blocks of 4, read again
    assert np.abs(again - first).max() < 1e-6 and np.abs(again - hf_vector(hf_model, PROMPTS[3], "LAST")).max() < 1e-5
    mean = LLM(directory, task="embed", pooler_config={"pooling_type": "MEAN"}, **SMALL_STEPS)
    assert not mean.llm_engine.args.enable_prefix_caching


def test_prompts_wait_for_room_in_a_small_cache_and_give_it_back(tiny_llama):
    """Six 50-token prompts, 8 tokens a step, in a cache that holds two of them: each is admitted with its whole
    prompt's blocks (so nothing preempts it mid-prompt), pooled over 7 steps, and its blocks freed for the next."""
    directory, hf_model = tiny_llama
    llm = LLM(directory, task="embed", pooler_config={"pooling_type": "MEAN"}, num_gpu_blocks_override=26,
              max_model_len=64, **{**SMALL_STEPS, "max_num_batched_tokens": 8})
    prompts = [list(range(i, i + 50)) for i in range(3, 9)]
    outputs = llm.encode(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert np.abs(output.outputs.data - hf_vector(hf_model, prompt, "MEAN")).max() < 1e-5
    stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] == 0 and stats["num_free_blocks"] == stats["num_blocks"] == 26
    assert stats["mean_batch_size"] <= 2


def test_an_embedding_engine_compiles_its_step_alone_and_nothing_after_start_up(tiny_llama):
    """It samples nothing: start-up compiles the step at each token bucket, not the logits and sampler programs
    (most of a generating engine's cold start), and pooling prompts of several lengths, one of them from the
    prefix cache, compiles nothing more."""
    directory, hf_model = tiny_llama
    llm = LLM(directory, task="embed", compilation_cache_dir="", **{**SMALL_STEPS, "enforce_eager": False})
    programs = llm.llm_engine.runner.programs
    assert programs.startup and {key[0] for key in programs.startup} == {"step"}
    outputs = llm.encode([PROMPTS[3], PROMPTS[2], [5, 6]], use_tqdm=False)
    llm.encode(PROMPTS[3][:-2], use_tqdm=False)  # its blocks from the prefix cache
    assert llm.llm_engine.stats()["prefix_cache_hits"] > 0 and programs.num_late_compiles == 0
    assert np.abs(outputs[1].outputs.data - hf_vector(hf_model, PROMPTS[2], "LAST")).max() < 1e-5


def test_a_request_for_the_other_task_is_refused_naming_it(tiny_llama, tiny_checkpoint):
    directory, _ = tiny_llama
    embedder = LLM(directory, task="embed", **SMALL_STEPS)
    with pytest.raises(ValueError, match="task: this engine was started with task='embed'"):
        embedder.generate("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match=r"dimensions must be at most the model's hidden size \(64\)"):
        embedder.embed("Hello", PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be at most max_model_len=256 tokens"):
        embedder.embed([[5] * 257], use_tqdm=False)
    assert len(embedder.embed([[5] * 256], use_tqdm=False)[0].outputs.embedding) == 64  # no room for output needed
    assert not embedder.llm_engine.has_unfinished_requests()
    generator = LLM(directory, enforce_eager=True)
    with pytest.raises(ValueError, match="task: embeddings need an engine started with task='embed'"):
        generator.embed("Hello", use_tqdm=False)
    assert generator.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(task="classify"), r"task must be one of \['generate', 'embed'\]"),
    (dict(task="embed", pooler_config={"pooling_type": "CLS"}), "pooler_config.pooling_type must be one of"),
    (dict(task="embed", pooler_config={"pooling": "MEAN"}), r"pooler_config has unknown keys \['pooling'\]"),
    (dict(pooler_config={"pooling_type": "MEAN"}), "pooler_config is for task='embed'"),
    (dict(task="embed", speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "task='embed' generates nothing"),
])
def test_bad_embedding_engine_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dimensions=0), "dimensions must be an integer >= 1"),
    (dict(normalize="yes"), "normalize must be true or false"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be an integer >= 1"),
])
def test_bad_pooling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolingParams(**kwargs)


@pytest.fixture(scope="module")
def embedding_server(tiny_llama, tmp_path_factory):
    directory, _ = tiny_llama
    log = tmp_path_factory.mktemp("server") / "server.log"
    process, url = start_server_process(directory, *cli_flags(**TINY_ENGINE_ARGS, task="embed"),
                                        "--pooler-config", '{"pooling_type": "MEAN"}', "--served-model-name", "tiny",
                                        "--max-request-tokens", "300", log_path=str(log))
    yield url
    stop_server_process(process)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_the_openai_client_gets_the_embeddings_of_text_and_token_ids(embedding_server, tiny_llama):
    """The client asks for base64 unless told otherwise (and decodes it with NumPy); float gives the same."""
    from transformers import AutoTokenizer

    directory, hf_model = tiny_llama
    client = openai.OpenAI(base_url=f"{embedding_server}/v1", api_key="none", max_retries=0)
    texts = ["Hello there", "A second, longer input than the first one."]
    answer = client.embeddings.create(model="tiny", input=texts)
    tokens = [AutoTokenizer.from_pretrained(directory).encode(t) for t in texts]
    assert [d.index for d in answer.data] == [0, 1] and answer.usage.prompt_tokens == sum(map(len, tokens))
    for data, ids in zip(answer.data, tokens):
        assert np.abs(np.asarray(data.embedding) - hf_vector(hf_model, ids, "MEAN")).max() < 1e-5
    floats = client.embeddings.create(model="tiny", input=PROMPTS[:2], encoding_format="float", dimensions=16)
    for data, ids in zip(floats.data, PROMPTS):
        vector = hf_vector(hf_model, ids, "MEAN", normalize=False)[:16]
        assert np.abs(np.asarray(data.embedding) - vector / np.linalg.norm(vector)).max() < 1e-5
    raw = client.embeddings.create(model="tiny", input=PROMPTS[2], extra_body={"normalize": False}).data[0]
    assert np.abs(np.asarray(raw.embedding) - hf_vector(hf_model, PROMPTS[2], "MEAN", normalize=False)).max() < 1e-5


def test_bad_embedding_requests_get_a_400_naming_the_field(embedding_server):
    client = openai.OpenAI(base_url=f"{embedding_server}/v1", api_key="none", max_retries=0)
    cases = [
        (dict(input=[[5] * 100] * 4), "input", "more than this server's limit of 300 tokens"),  # --max-request-tokens
        (dict(input=[[5] * 129]), "input", "input must be at most max_model_len=128 tokens"),
        (dict(input=[]), "input", "input must not be empty"),
        (dict(input=""), "input", "input must not be empty"),
        (dict(input=[[70000]]), "input", r"input token ids must be in \[0, vocab_size="),
        (dict(input="hi", dimensions=65), "dimensions", "at most the model's hidden size"),
        (dict(input="hi", extra_body={"pooling": "CLS"}), "pooling", "not supported"),
        (dict(input="hi", extra_body={"priority": 2}), "priority", "unless scheduling_policy is 'priority'"),
    ]
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as error:
            client.embeddings.create(model="tiny", **fields)
        assert error.value.body["param"] == param
    with pytest.raises(openai.BadRequestError, match="task: this engine was started with task='embed'") as error:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert error.value.body["param"] == "task"
    assert len(client.embeddings.create(model="tiny", input=[[5] * 128]).data[0].embedding) == 64  # still serving


def test_a_largest_request_and_a_bystander_are_both_answered(embedding_server, tiny_llama):
    """The most one request may send (300 tokens here) runs beside a one-input request, which is answered right."""
    from concurrent.futures import ThreadPoolExecutor

    _, hf_model = tiny_llama
    client = openai.OpenAI(base_url=f"{embedding_server}/v1", api_key="none", max_retries=0)
    with ThreadPoolExecutor(2) as pool:
        largest = pool.submit(client.embeddings.create, model="tiny", input=[[5] * 128, [6] * 128, [7] * 44])
        bystander = pool.submit(client.embeddings.create, model="tiny", input=PROMPTS[1])
        assert len(largest.result().data) == 3
        vector = np.asarray(bystander.result().data[0].embedding)
    assert np.abs(vector - hf_vector(hf_model, PROMPTS[1], "MEAN")).max() < 1e-5
