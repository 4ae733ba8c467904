"""Multi-LoRA serving in the engine (issue 46): adapters in device slots, a batch mixing them row by row.

Checked against HF transformers + PEFT (logits at every position, several families), against each request run
alone (a mixed batch of four adapters and the base model), and for what serving needs: a request waits for a
slot, prefix caching keyed by adapter, preemption, n > 1, beam search, structured output, bad adapters refused at
add_request beside a running request, and no compile after start-up when adapters come and go.
"""

import numpy as np
import pytest

from jax_engine import LLM, BeamSearchParams, LoRARequest, SamplingParams
from jax_engine.loader import load_checkpoint
from jax_engine.lora.layout import LoRALayout
from jax_engine.structured_output.params import StructuredOutputsParams
from tests.engine_helpers import engine_logits
from tests.test_lora import write_adapter, write_huge_copy
from tests.test_llama_vs_hf import hf_logits
from tests.tiny_checkpoints import make_tiny_checkpoint

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 61], [9, 8, 7, 6, 5], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
           [33, 34, 35], [200, 3, 200, 4, 200, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
ENGINE = dict(num_gpu_blocks_override=64, block_size=4, max_model_len=128, max_num_seqs=8, enforce_eager=True)


def adaptable_modules(directory) -> list[str]:
    """The short names of every module the engine can adapt in this checkpoint (PEFT's target_modules)."""
    checkpoint = load_checkpoint(str(directory))
    layout = LoRALayout.of(checkpoint.config, checkpoint.weights, max_loras=1, max_rank=8)
    return sorted({module.rsplit(".", 1)[-1] for module in layout.module_shapes()})


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A tiny Llama and four adapters of ranks 2-8 over different modules: (base directory, LoRARequests)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-engine")
    make_tiny_checkpoint(root / "base", "llama")
    configs = [dict(r=4), dict(r=8, use_rslora=True, lora_alpha=4), dict(r=2, target_modules=["q_proj", "v_proj"]),
               dict(r=6, target_modules=["gate_proj", "down_proj", "o_proj"])]
    requests = []
    for i, config in enumerate(configs):
        write_adapter(AutoModelForCausalLM.from_pretrained(root / "base"), root / f"a{i}", seed=20 + i, **config)
        requests.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return root / "base", requests


@pytest.fixture(scope="module")
def llm(adapters):
    base, _ = adapters
    return LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=8, **ENGINE)


def alone(llm, prompts, requests, params=GREEDY) -> list[list[int]]:
    """Each prompt's tokens, run one request at a time."""
    return [llm.generate([p], params, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
            for p, r in zip(prompts, requests)]


@pytest.mark.parametrize("architecture", ["llama", "opt", "phi3", "gpt_neox"])  # q/k/v + gate/up, fc1/fc2, fused qkv, MLP only
def test_engine_logits_with_an_adapter_equal_peft(tmp_path, architecture):
    """Every adaptable module of the family (gpt_neox: its MLP; its fused, reordered QKV is refused), logits at
    every position through steps of few rows (the CPU kernel's) and a chunk of 67 tokens (past KERNEL_ROWS: XLA's
    masked form)."""
    from transformers import AutoModelForCausalLM

    make_tiny_checkpoint(tmp_path / "base", architecture)
    modules = adaptable_modules(tmp_path / "base")
    peft_model = write_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter", seed=3,
                               target_modules=modules, r=8)
    prompt = (PROMPTS[0] + PROMPTS[2]) * 4  # 72 tokens
    expected = hf_logits(peft_model, prompt)
    with peft_model.disable_adapter():
        base_logits = hf_logits(peft_model, prompt)
    ours = engine_logits(load_checkpoint(str(tmp_path / "base")), prompt, [3, 1, 1, 67],
                         lora_request=LoRARequest("adapter", 1, str(tmp_path / "adapter")))
    diff = np.abs(ours - expected).max()
    print(f"{architecture} ({', '.join(modules)}): max |logit diff| vs PEFT = {diff:.2e}")
    assert diff < 1e-5  # float32, as the engine against HF without adapters (test_engine_model_vs_hf.py)
    assert np.abs(expected - base_logits).max() > 1e-2  # the adapter changes the logits


def test_engine_logits_with_an_adapter_equal_the_oracles(adapters):
    """The engine against the NumPy oracle's forward pass with the same adapter (reference/lora.py), at every
    position: each adapter of the fixture, q/v-only and rsLoRA ones included."""
    from jax_engine.loader.lora import load_lora_adapter, module_shapes
    from reference.kv_cache import KVCache
    from reference.llama import LlamaModel
    from reference.paged_attention import AttentionMetadata

    base, requests = adapters
    checkpoint = load_checkpoint(str(base))
    cfg, oracle = checkpoint.config, LlamaModel(checkpoint.config, checkpoint.weights)
    prompt = PROMPTS[0] + PROMPTS[2]
    for request in requests:
        adapter = load_lora_adapter(request.lora_path, module_shapes(checkpoint.weights), request.lora_name)
        cache = KVCache(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
        metadata = AttentionMetadata(np.arange(len(prompt)), np.array([0, len(prompt)]), np.array([len(prompt)]),
                                     [[0, 1]])
        expected = oracle.forward(np.array(prompt), np.arange(len(prompt)), cache, metadata,
                                  adapters=[adapter] * len(prompt))
        ours = engine_logits(checkpoint, prompt, [5, 1, 12], lora_request=request)
        diff = np.abs(ours - expected).max()
        print(f"{request.lora_name}: max |logit diff| vs the oracle = {diff:.2e}")
        assert diff < 1e-5  # float32 both sides, sums in another order: ~5e-7 seen


def test_the_default_model_with_an_adapter_equals_peft(default_checkpoint, tmp_path):
    """SmolLM2-135M with a random rank-8 adapter on every projection: the engine's logits at every position
    against HF + PEFT on the same weights (the default model's checkpoint in HF's Llama class)."""
    from jax_engine.bench.hf_baseline import hf_model_from_checkpoint

    peft_model = write_adapter(hf_model_from_checkpoint(default_checkpoint), tmp_path / "adapter", seed=4, r=8,
                               lora_alpha=16)
    prompt = default_checkpoint.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    expected = hf_logits(peft_model, prompt)
    with peft_model.disable_adapter():
        base_logits = hf_logits(peft_model, prompt)
    ours = engine_logits(default_checkpoint, prompt, [len(prompt) - 2, 1, 1], block_size=16,
                         lora_request=LoRARequest("adapter", 1, str(tmp_path / "adapter")))
    diff = np.abs(ours - expected).max()
    print(f"SmolLM2-135M + LoRA: max |logit diff| vs PEFT = {diff:.2e}")
    assert diff < 1e-3  # as the default model without an adapter (test_engine_model_vs_hf.py): ~1e-4 seen
    assert np.abs(expected - base_logits).max() > 0.1 and (ours.argmax(-1) == expected.argmax(-1)).all()


def test_programs_take_the_arrays_an_adapter_slot_holds_now(adapters):
    """The runner hands its programs the model's arrays flattened once (runner/flat_model.py), as start-up does
    before any adapter is in a slot: writing a slot must flatten them again, or every step keeps zeros there."""
    import jax
    from jax_engine.attention import get_attention_backend
    from jax_engine.models.causal_lm import CausalLM
    from jax_engine.runner.model_runner import ModelRunner

    base, requests = adapters
    checkpoint = load_checkpoint(str(base))
    model = CausalLM.from_hf_weights(checkpoint.config, checkpoint.weights)
    model.add_lora_slots(LoRALayout.of(checkpoint.config, checkpoint.weights, max_loras=2, max_rank=8))
    runner = ModelRunner(model, 8, 4, 0, 32, 1, get_attention_backend("xla", "cpu"), np.float32, max_cpu_loras=2)
    before = runner.flat_model
    runner.lora.activate({requests[0]})
    assert all(a is b for a, b in zip(runner.flat_model.arrays, jax.tree.leaves(model), strict=True))
    assert runner.flat_model is runner.flat_model  # kept while no slot is written
    assert any(a is not b for a, b in zip(before.arrays, runner.flat_model.arrays))


def test_a_mixed_batch_equals_each_request_alone(llm, adapters):
    """Four adapters and the base model in one batch, each adapter twice: row by row, the same greedy tokens
    as each request alone; and the five differ on one prompt (so each row's own adapter mattered)."""
    _, requests = adapters
    prompts = PROMPTS + PROMPTS[:3]
    chosen = [None, *requests, requests[0], requests[1], None]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=chosen)]
    assert together == alone(llm, prompts, chosen)
    with_logprobs = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    same_prompt = llm.generate([PROMPTS[0]] * 5, with_logprobs, use_tqdm=False, lora_request=[None, *requests])
    assert len({round(o.outputs[0].cumulative_logprob, 3) for o in same_prompt}) == 5


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_wait_for_a_slot(adapters, async_scheduling):
    """max_loras=1: three adapters and the base model queued at once all finish, as alone; no step ever runs two
    adapters, and the base model's request is not held up behind the adapters' (it runs in the first step). With
    async scheduling too, where a step is planned before the one in flight has ended its sequences."""
    base, requests = adapters
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2,
              async_scheduling=async_scheduling, **ENGINE)
    engine = llm.llm_engine
    steps = []
    activate = engine.runner.lora.activate
    engine.runner.lora.activate = lambda wanted: steps.append({r.lora_name for r in wanted}) or activate(wanted)
    chosen = [requests[0], requests[1], None, requests[2]]
    outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False, lora_request=chosen)
    assert [o.outputs[0].token_ids for o in outputs] == alone(llm, PROMPTS[:4], chosen)
    assert max(len(s) for s in steps[:len(steps) // 2]) == 1 and all(len(s) <= 1 for s in steps)
    assert outputs[2].metrics.first_token_time <= outputs[1].metrics.first_token_time


def test_prefix_cache_is_keyed_by_adapter(llm, adapters):
    _, (first, second, *_) = adapters
    prompt = list(range(10, 30))  # five full blocks of 4
    cached = [llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=r)[0].num_cached_tokens
              for r in (first, second, None, first, second, None)]
    assert cached[:3] == [0, 0, 0] and min(cached[3:]) >= 16


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_requests_keep_their_adapters(adapters, preemption_mode):
    """A cache of 12 blocks of 4 for 5 requests that each grow to ~8 blocks: preemption on every run."""
    base, requests = adapters
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=8, preemption_mode=preemption_mode,
              swap_space=0.01, **{**ENGINE, "num_gpu_blocks_override": 12, "max_model_len": 48})
    chosen = [None, *requests]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=chosen)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone(llm, PROMPTS, chosen, params)


def test_parallel_samples_and_beams_run_with_their_adapter(llm, adapters):
    _, requests = adapters
    greedy = alone(llm, [PROMPTS[1]], [requests[1]])[0]
    samples = llm.generate([PROMPTS[1]], SamplingParams(n=3, temperature=0, max_tokens=6), use_tqdm=False,
                           lora_request=requests[1])[0]
    assert [c.token_ids for c in samples.outputs] == [greedy] * 3
    beams = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=4), lora_request=requests[1])
    for beam in beams[0].sequences:  # each beam's score is its tokens' logprobs under the adapter
        scored = llm.generate([beam.tokens], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False,
                              lora_request=requests[1])[0]
        generated = range(len(PROMPTS[1]), len(beam.tokens))
        expected = sum(scored.prompt_logprobs[i][beam.tokens[i]].logprob for i in generated)
        assert beam.cum_logprob == pytest.approx(expected, abs=1e-4)


def test_structured_output_with_an_adapter(llm, adapters):
    _, requests = adapters
    choice = StructuredOutputsParams(choice=("yes", "no"))
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice)
    outputs = llm.generate([PROMPTS[0]] * 3, params, use_tqdm=False, lora_request=[None, requests[0], requests[2]])
    assert all(o.outputs[0].text in ("yes", "no") for o in outputs)


def test_bad_adapters_are_refused_at_add_request_beside_a_running_request(llm, adapters, tmp_path):
    base, requests = adapters
    engine = llm.llm_engine
    engine.add_request("bystander", PROMPTS[0], GREEDY, lora_request=requests[0])
    engine.step()
    write_adapter(make_tiny_checkpoint(tmp_path / "same-base", "llama"), tmp_path / "wide", seed=5, r=16)
    with pytest.raises(ValueError, match="rank r=16 is above max_lora_rank=8"):
        engine.add_request("too-wide", PROMPTS[1], GREEDY, lora_request=LoRARequest("wide", 9, str(tmp_path / "wide")))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_request("missing", PROMPTS[1], GREEDY, lora_request=LoRARequest("gone", 10, str(tmp_path / "gone")))
    renamed = LoRARequest("a0-again", 1, requests[0].lora_path)
    with pytest.raises(ValueError, match="has lora_int_id 1; got 'a0-again' with lora_int_id 1"):
        engine.add_request("renamed", PROMPTS[1], GREEDY, lora_request=renamed)
    with pytest.raises(ValueError, match="lora_int_id must be an int > 0"):
        LoRARequest("zero", 0, requests[0].lora_path)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["bystander"]
    assert finished[0].outputs[0].token_ids == alone(llm, [PROMPTS[0]], [requests[0]])[0]
    assert engine.scheduler.kv.device.num_free_blocks == 64  # nothing held (cached blocks count as free)
    plain = LLM(str(base), **ENGINE)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([PROMPTS[0]], GREEDY, lora_request=requests[0], use_tqdm=False)


def test_an_adapter_of_huge_values_reaches_no_other_row(llm, adapters, tmp_path):
    """An adapter whose A is finite but huge (every shrink against its slot overflows to inf) beside the base
    model and another adapter, in steps of more than KERNEL_ROWS rows (XLA's masked form, every row against
    every slot): the other two get their tokens alone. When the mask was multiplied in, 0 x inf made them NaN."""
    from jax_engine.linear.lora_bgmv import KERNEL_ROWS

    _, requests = adapters
    huge = LoRARequest("huge", 7, write_huge_copy(requests[0].lora_path, tmp_path / "huge"))
    prompt = list(range(5, 5 + KERNEL_ROWS + 16))
    expected = alone(llm, [prompt] * 2, [None, requests[1]])  # first: NaN keys and values would be prefix-cached
    try:
        outputs = llm.generate([prompt] * 3, GREEDY, use_tqdm=False, lora_request=[None, huge, requests[1]])
        assert [outputs[0].outputs[0].token_ids, outputs[2].outputs[0].token_ids] == expected
    finally:
        llm.llm_engine.remove_lora(huge.lora_int_id)


def test_adapters_are_added_and_removed_at_run_time(llm, adapters):
    _, requests = adapters
    engine = llm.llm_engine
    assert engine.add_lora(requests[3]) and requests[3].lora_int_id in engine.list_loras()
    engine.add_request("user", PROMPTS[0], GREEDY, lora_request=requests[3])
    with pytest.raises(ValueError, match="in use by 1 unfinished requests"):
        engine.remove_lora(requests[3].lora_int_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(requests[3].lora_int_id) and requests[3].lora_int_id not in engine.list_loras()
    assert requests[3].lora_int_id not in engine.runner.lora.slots and not engine.remove_lora(99)


def test_adapters_coming_and_going_compile_nothing_after_start_up(adapters):
    """Start-up compiles every step shape with the slots in it; then five adapters through two slots (each new one
    evicts the least recently used) and the base model compile nothing: a slot is rewritten, not reshaped."""
    from tests.test_compile_shapes import compiles, jax_events

    base, requests = adapters
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, compilation_cache_dir="",
              **{**ENGINE, "enforce_eager": False, "max_num_batched_tokens": 32, "max_num_seqs": 4})
    fifth = LoRARequest("a0-copy", 5, requests[0].lora_path)
    with jax_events() as events:
        for chosen in ([requests[0], None], [requests[1], requests[2]], [requests[3], fifth], [requests[0], None]):
            outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=chosen)
            assert all(o.finished for o in outputs)
    assert compiles(events) == [] and llm.llm_engine.runner.programs.num_late_compiles == 0
    assert sorted(llm.llm_engine.runner.lora.slots) == [1, 5]  # a0 came back into a3's slot; a0-copy stayed


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_cpu_kernel_equals_the_masked_form(rows):
    """The C++ BGMV kernel (each row's own slot, read in place) against XLA's masked form (every slot, masked),
    on random stacks of three unequal pieces, rows of every slot and rows without an adapter."""
    import jax
    import jax.numpy as jnp

    from jax_engine.linear.lora_bgmv import kernel_unavailable_reason, lora_bgmv
    from jax_engine.models.lora import LoRABatch

    if kernel_unavailable_reason() is not None:
        pytest.skip(kernel_unavailable_reason())
    with jax.default_device(jax.devices("cpu")[0]):  # a host kernel: on a GPU machine too it runs on the CPU
        rng = np.random.default_rng(rows)
        L, S, r, width, pieces = 3, 4, 8, 48, ((0, 32), (32, 40), (40, 48))
        a = jnp.asarray(rng.standard_normal((L, S, len(pieces), r, width)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((L, S, r, 48)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)
        slots = jnp.asarray(rng.integers(-1, S, rows), jnp.int32)
        batch = LoRABatch.of(slots, S, {"qkv": pieces}, jnp.float32)
        kernel = lora_bgmv(x, a, b, slots, jnp.int32(2), [0, 32, 40, 48])
        masked = batch._masked("qkv", x, a[2], b[2])
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(masked), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(kernel)[np.asarray(slots) < 0] == 0)
