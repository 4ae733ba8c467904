"""Tensor parallelism (jax_engine/distributed/tensor_parallel.py) against the unsplit model: tp = 2, 3 and 4
over SmolLM2's 9 query / 3 KV heads (3 divides them; 2 and 4 pad with empty heads), tp = 3 and 4 over tiny
random checkpoints of every family (vocabularies and MLP widths they do not divide, MQA, ALiBi, biases), and
LoRA adapters split with their base weights."""

import re

import jax
import numpy as np
import pytest

from jax_engine import LLM, EngineArgs, LLMEngine, LoRARequest, SamplingParams
from jax_engine.runner.compile_shapes import startup_programs
from jax_engine.distributed.tensor_parallel import head_layout, make_mesh
from jax_engine.loader import load_checkpoint
from tests.engine_helpers import engine_logits
from tests.quick_compiles import users_compiled_text
from tests.test_llama_vs_hf import PROMPT
from tests.test_lora import write_adapter
from tests.test_lora_engine import PROMPTS as LORA_PROMPTS, adaptable_modules
from tests.test_model_families import ATTENTION_VARIANTS, VARIANTS
from tests.tiny_checkpoints import make_tiny_checkpoint

SIZES = (2, 3, 4)
PREFIX = "The history of paged memory in operating systems begins with"
PROMPTS = [PREFIX + " the Atlas computer", PREFIX + " a question:", "def fibonacci(n):", "1, 2, 3, 5, 8,"]
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8, enforce_eager=True)


@pytest.fixture(scope="module")
def make_llm(default_checkpoint):
    def make(tp: int, **kwargs) -> LLM:
        args = EngineArgs(tensor_parallel_size=tp, **{**ENGINE_ARGS, **kwargs})
        return LLM.from_engine(LLMEngine(args, checkpoint=default_checkpoint))

    return make


def generate(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def unsplit(make_llm):
    """tp = 1's greedy tokens and seeded n = 2 samples, with the cache small enough to preempt."""
    llm = make_llm(1, num_gpu_blocks_override=24)
    return generate(llm, GREEDY), generate(llm, SAMPLES)


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SAMPLES = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)


# Once where 3 KV heads divide evenly (recompute) and once where they are padded (swap: swapping moves the cache's
# KV-head shards, padded ones too). Each case is the suite's costliest (~45 s on 2 cores), so not every pairing:
# the layouts split alike whatever preempts them. tp = 4 pads as tp = 2 does; its logits are checked below.
@pytest.mark.parametrize(("preemption_mode", "tp"), [("recompute", 3), ("swap", 2)])
def test_default_model_tokens_equal_unsplit(make_llm, unsplit, tp, preemption_mode):
    """4 prompts x 40 greedy tokens in 24 blocks of 8 (preempted on the way); then n = 2 seeded samples of the
    same prompts, whose blocks are then cached: the same tokens as tp = 1."""
    llm = make_llm(tp, num_gpu_blocks_override=24, preemption_mode=preemption_mode)
    engine = llm.llm_engine
    assert engine.runner.k_cache.sharding.spec[3] == "tp" and len(engine.runner.k_cache.sharding.device_set) == tp
    assert generate(llm, GREEDY) == unsplit[0]
    assert engine.scheduler.num_preemptions > 0
    assert generate(llm, SAMPLES) == unsplit[1]
    assert engine.scheduler.kv.prefix_cache_hits > 0
    assert engine.scheduler.kv.usage == 0  # nothing lost


@pytest.mark.parametrize("tp", SIZES)
def test_default_model_logits_close_to_unsplit(default_checkpoint, tp):
    """Every position's logits, prefill and decode-sized chunks: the psums add the partial products in another
    order than one matmul does, so float32 rounding differs: ~5e-5 of logits up to ~30 seen, 2e-4 bound."""
    chunks = [9, 1, 1, 10]
    ids = default_checkpoint.tokenizer.encode(" ".join(PROMPTS))[:21]
    expected = engine_logits(default_checkpoint, ids, chunks, block_size=8, backend="cpu")
    split = engine_logits(default_checkpoint, ids, chunks, block_size=8, backend="cpu", mesh=make_mesh(tp))
    assert np.abs(split - expected).max() < 2e-4
    assert (split.argmax(-1) == expected.argmax(-1)).all()


def backends(variant: str) -> tuple[str, ...]:
    """The cpu kernel for every variant; xla too where ALiBi or a window change attention; the Pallas kernels
    (interpreted on CPU, slow) for one GQA and one ALiBi variant."""
    extra = ("xla",) if variant in ATTENTION_VARIANTS else ()
    return ("cpu", *extra, *(("pallas",) if variant in ("llama", "bloom") else ()))


def test_a_draft_model_splits_over_its_targets_mesh(tiny_checkpoint):
    """A draft model's weights and KV cache are split over the target's devices as the target's are: drafting for
    itself under tp = 2, the tiny model accepts every draft and writes unsplit's tokens."""
    args = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=4, num_gpu_blocks_override=32,
                enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["abcabc", "the cat"]
    unsplit_llm = LLM.from_engine(LLMEngine(EngineArgs(**args), checkpoint=tiny_checkpoint))
    draft = {"model": "self", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    split = LLM.from_engine(LLMEngine(EngineArgs(tensor_parallel_size=2, speculative_config=draft, **args),
                                      checkpoint=tiny_checkpoint))
    cache = split.llm_engine.speculator.draft.runner.k_cache
    assert cache.sharding.spec[3] == "tp" and len(cache.sharding.device_set) == 2
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
              for llm in (unsplit_llm, split)]
    assert tokens[1] == tokens[0]
    assert split.llm_engine.stats()["spec_decode"]["acceptance_rate"] == 1.0


# tp = 2 divides everything a tiny checkpoint has (4 heads over 2 KV heads, 6 in BLOOM, vocabulary 258, MLP 128
# or 256), so it would check no split that these miss: tp = 3 pads the heads (BLOOM's aside) and the MLP; tp = 4
# repeats KV heads and pads the vocabulary (and BLOOM's heads). The default model's tests above run tp = 2.
FAMILY_SIZES = (3, 4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_family_splits(tmp_path, variant):
    """Tiny random checkpoints (4 heads over 2 KV heads, 1 with MQA, 6 in BLOOM; vocabulary 258; MLP 128 or 256),
    prefill and chunked decode, tp = 3 and 4, through every attention backend under shard_map."""
    model_type, overrides = VARIANTS[variant]
    make_tiny_checkpoint(tmp_path, model_type, **overrides)
    checkpoint = load_checkpoint(str(tmp_path))
    for backend in backends(variant):
        expected = engine_logits(checkpoint, PROMPT, [9, 1, 11], backend=backend)
        for tp in FAMILY_SIZES:
            split = engine_logits(checkpoint, PROMPT, [9, 1, 11], backend=backend, mesh=make_mesh(tp))
            assert np.abs(split - expected).max() < 1e-5, (backend, tp)  # same bound as vs HF (test_model_families)


def test_step_has_one_all_reduce_after_attention_and_one_after_the_mlp(make_llm):
    """The compiled step's collectives: in the layer loop's body exactly two all-reduces (o and down), one
    more for the embedding lookup, nothing that gathers or moves weights; the logits one all-gather."""
    assert_collectives(make_llm(3).llm_engine.runner)


def assert_collectives(runner) -> None:
    programs = startup_programs(runner, 64)
    step, logits = (users_compiled_text(next(p for p in programs if p.key[0] == kind).lower())
                    for kind in ("step", "logits"))
    reduces = re.findall(r"all-reduce(?:-start)?\(.*op_name=\"([^\"]+)\"", step)
    assert len(reduces) == 3
    assert sum("while/body" in name for name in reduces) == 2
    for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert not re.search(rf" {op}(-start)?\(", step), op
    assert len(re.findall(r" all-gather(?:-start)?\(", logits)) == 1


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "per_device"), [
    (9, 3, 3, (3, 1)), (9, 3, 2, (6, 2)), (9, 3, 4, (3, 1)), (8, 2, 4, (2, 1)), (4, 1, 4, (1, 1)), (6, 6, 4, (2, 2))])
def test_head_layout(heads, kv_heads, tp, per_device):
    """Every query head lands on one device, with the KV head it reads (GQA: local j reads j // group)."""
    layout = head_layout(heads, kv_heads, tp)
    assert {(len(q), len(kv)) for q, kv in zip(layout.q, layout.kv)} == {per_device}
    placed = sorted(h for q in layout.q for h in q if h >= 0)
    assert placed == list(range(heads))
    for q, kv in zip(layout.q, layout.kv):
        group = len(q) // len(kv)
        for j, head in enumerate(q):
            if head >= 0:
                assert kv[j // group] == head // (heads // kv_heads)


# Llama's q/k/v and gate/up pieces and its o/down split by input, at tp = 3 (padded heads and MLP) and 4 (repeated KV
# heads); GPT-NeoX's MLP, an up projection of one piece (as Phi-3's fused ones), at tp = 3, where its width is padded.
@pytest.mark.parametrize(("architecture", "sizes"), [("llama", FAMILY_SIZES), ("gpt_neox", (3,))])
def test_lora_adapters_split_with_their_weights(tmp_path, architecture, sizes):
    """An adapter on every module the family can adapt: every position's logits equal unsplit's, through steps
    of few rows (the CPU kernel, run on each device's slices) and a chunk of 67 (XLA's masked form). Unsplit
    equals PEFT (tests/test_lora_engine.py)."""
    from transformers import AutoModelForCausalLM

    make_tiny_checkpoint(tmp_path / "base", architecture)
    write_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter", seed=3,
                  target_modules=adaptable_modules(tmp_path / "base"), r=8)
    checkpoint, request = load_checkpoint(str(tmp_path / "base")), LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompt, chunks = (LORA_PROMPTS[0] + LORA_PROMPTS[2]) * 4, [3, 1, 1, 67]
    expected = engine_logits(checkpoint, prompt, chunks, backend="cpu", lora_request=request)
    assert np.abs(expected - engine_logits(checkpoint, prompt, chunks, backend="cpu")).max() > 0.1  # it matters
    for tp in sizes:
        split = engine_logits(checkpoint, prompt, chunks, backend="cpu", lora_request=request, mesh=make_mesh(tp))
        assert np.abs(split - expected).max() < 1e-5, tp  # as the families' splits: ~4e-7 seen


def test_mixed_adapters_under_tensor_parallelism(tmp_path):
    """Three adapters and the base model in one batch over two slots under tp = 3: slots are rewritten while
    requests wait for one, and every request's tokens equal unsplit's; the step gains no collective."""
    from transformers import AutoModelForCausalLM

    make_tiny_checkpoint(tmp_path / "base", "llama")
    requests = [None]
    for i, modules in enumerate((None, ["q_proj", "v_proj"], ["gate_proj", "down_proj", "o_proj"])):
        write_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / f"a{i}", seed=30 + i,
                      r=4, **({} if modules is None else {"target_modules": modules}))
        requests.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
    prompts, chosen = LORA_PROMPTS[:4] * 2, requests * 2
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = []
    for tp in (1, 3):
        llm = LLM(str(tmp_path / "base"), tensor_parallel_size=tp, enable_lora=True, max_loras=2, max_lora_rank=8,
                  num_gpu_blocks_override=64, block_size=4, max_model_len=64, max_num_seqs=8, enforce_eager=True)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False,
                                                                     lora_request=chosen)])
        if tp == 1:
            base = [o.outputs[0].token_ids for o in llm.generate(prompts[1:4], params, use_tqdm=False)]
    assert tokens[1] == tokens[0]
    assert all(ours != theirs for ours, theirs in zip(tokens[0][1:4], base))  # each adapter mattered
    assert_collectives(llm.llm_engine.runner)


def test_more_devices_than_exist_is_an_error():
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be <= the number of devices \(4"):
        LLM(tensor_parallel_size=8)
    assert jax.device_count() == 4
