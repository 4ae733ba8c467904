"""The few-rows matmul kernel against NumPy, and weight-only quantization (bf16, int8, GGUF blocks) against float32."""

import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_engine.linear import matmul  # the module: tests set its MANY_ROWS_KERNEL
from jax_engine.linear.gguf_blocks import dequantize_blocks
from jax_engine.linear.gguf_format import FORMATS, as_q8_0
from jax_engine.linear.matmul import (FEW_ROWS, GGUF_FEW_ROWS, few_rows_matmul, kernel_unavailable_reason, linear,
                                     uses_few_rows_kernel)
from jax_engine.linear.quantization import quantize
from tests.engine_helpers import engine_logits

needs_kernel = pytest.mark.skipif(jax.default_backend() != "cpu" or kernel_unavailable_reason() is not None,
                                  reason=f"no few-rows kernel here: {kernel_unavailable_reason()}")
K_QUANTS = ["q4_k", "q5_k", "q6_k"]  # super-blocks of 256 weights
GGUF_KINDS = ["q8_0", "q4_0", "q4_1", "q5_0", *K_QUANTS]  # GGUF blocks, kept as the file stores them
WEIGHT_KINDS = ["float32", "bfloat16", "float16", "int8", *GGUF_KINDS]
ROUNDS_X = ("int8", *GGUF_KINDS)  # weights that multiply x rounded to 16 bits per row


def _random_k_quant(rng, n: int, k: int, kind: str) -> np.ndarray:
    """Random super-blocks (gguf-py has no K-quant quantizer): every bit random but d and dmin, finite float16
    values of about 0.001, so that the weights are of unit size like the other kinds' (scales up to 63)."""
    raw = rng.integers(0, 256, (n, k // 256, FORMATS[kind][1]), dtype=np.uint8)
    d_and_dmin = (rng.standard_normal((n, k // 256, 2)) * 0.001).astype(np.float16).view(np.uint8)
    if kind == "q6_k":  # d comes last, and there is no dmin
        raw[..., 208:210] = d_and_dmin[..., :2]
    else:
        raw[..., 0:4] = d_and_dmin
    return raw.reshape(n, -1)


def _weights(rng, n: int, k: int, kind: str) -> tuple[jax.Array, jax.Array | None, np.ndarray]:
    """(stored weight, scale or None, the float64 matrix they stand for)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    if kind in GGUF_KINDS:  # quantized (or for K-quants, dequantized) by gguf-py, llama.cpp's own Python package
        ggml_type = GGMLQuantizationType[kind.upper()]
        raw = _random_k_quant(rng, n, k, kind) if kind in K_QUANTS else gguf.quants.quantize(w, ggml_type)
        return jnp.asarray(raw), None, gguf.quants.dequantize(raw, ggml_type).astype(np.float64)
    if kind == "int8":
        stored, scale = quantize(w, "int8", jnp.float32)
        return stored, scale, np.asarray(stored, np.float64) * np.asarray(scale, np.float64)[:, None]
    stored = jnp.asarray(w, kind)
    return stored, None, np.asarray(stored.astype(jnp.float32), np.float64)


def _rows_rounded_to_int16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What int8 weights multiply: each row of x rounded to 16 bits (round_rows_to_int16, in NumPy), and the step."""
    peak = np.abs(x).max(axis=1, keepdims=True)
    inverse = np.where(peak > 0, np.float32(32767) / np.where(peak > 0, peak, 1), 1).astype(np.float32)
    step = np.where(peak > 0, peak / np.float32(32767), 1).astype(np.float32)
    return np.rint(x * inverse).astype(np.float64) * step, step.astype(np.float64)


@needs_kernel
@settings(max_examples=40)
@given(rows=st.integers(1, 70), k=st.integers(1, 40).map(lambda i: 8 * i), n=st.integers(1, 70),
       kind=st.sampled_from(WEIGHT_KINDS), layers=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_kernel_matches_the_plain_matmul(rows, k, n, kind, layers, seed):
    """Any rows, input width (a multiple of 8; of 16 for int8, of 32 or 256 for GGUF blocks), output width and
    weight type, tails of every block size; one matrix (layers=0) or a layer of a stack of them, read in place."""
    k += 8 * (kind == "int8" and k % 16 != 0)
    k += -k % FORMATS[kind][0] if kind in GGUF_KINDS else 0
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    stack = [_weights(rng, n, k, kind) for _ in range(max(layers, 1))]
    layer = int(rng.integers(len(stack)))
    if layers:
        w = jnp.stack([s[0] for s in stack])
        scale = None if kind != "int8" else jnp.stack([s[1] for s in stack])
    else:
        w, scale, _ = stack[0]
    exact = stack[layer][2]
    formats = (kind,) * max(layers, 1) if kind in GGUF_KINDS else None
    got = np.asarray(jax.jit(few_rows_matmul, static_argnames="formats")(x, w, scale, layer, formats))
    multiplied, step = _rows_rounded_to_int16(x) if kind in ROUNDS_X else (x.astype(np.float64), 0.0)
    # float32 sums of k products of unit-scale values: rounding grows like sqrt(k) x 2^-24 per term.
    float32_rounding = 1e-5 * np.sqrt(k) * max(1.0, np.abs(exact).max())
    np.testing.assert_allclose(got, multiplied @ exact.T, rtol=0, atol=float32_rounding)
    # And against x itself: rounding x moves each product by at most half a step times the weight.
    off = np.abs(got - x.astype(np.float64) @ exact.T)
    assert (off <= 0.5 * step * np.abs(exact).sum(axis=1) + float32_rounding).all()


@needs_kernel
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_blocks_times_few_and_many_rows_with_every_tail(kind):
    """Up to 8 rows the kernel streams the blocks. Past 8 it dequantizes 12 output features at a time (4 without
    AVX-512) and multiplies 16 rows a register (8), in chunks of 256 rows: 9, 17, 40 and 300 rows leave registers
    partly padded, and 17 features a tail of 4 and of 1."""
    rng = np.random.default_rng(7)
    k = FORMATS[kind][0] * 2
    w, _, exact = _weights(rng, 17, k, kind)
    for rows in (1, 2, 9, 17, 40, 300):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        got = np.asarray(jax.jit(few_rows_matmul, static_argnames="formats")(x, w, None, 0, (kind,)))
        multiplied, _ = _rows_rounded_to_int16(x)
        np.testing.assert_allclose(got, multiplied @ exact.T, rtol=0, atol=1e-5 * np.sqrt(k) * np.abs(exact).max())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6])
def test_int8_sums_are_exact_at_the_extremes(rows):
    """int8 weights of +-127 times rows of x that round to +-32767: the integer sums are the largest there are,
    over more than two spans of exact int32 sums and a last, partial vector (8208 = 2 x 4096 + 16 inputs).
    One and two rows take the VNNI path where the CPU has it (x split into bytes, weights + 128), more rows
    vpmaddwd; both must give the exact integer sum, scaled once in float32."""
    k, n = 8208, 24
    rng = np.random.default_rng(rows)
    w = (127 * rng.choice([-1, 1], size=(n, k))).astype(np.int8)
    w[::3] = 127  # rows of one sign: the sums reach k x 127 x 32767 ~ 3.4e10, far past int32
    x = rng.choice([-1.0, 1.0], size=(rows, k)).astype(np.float32) * 3.0
    x[0] = 3.0
    scale = rng.uniform(0.5, 2.0, n).astype(np.float32)
    got = np.asarray(jax.jit(few_rows_matmul)(x, jnp.asarray(w), jnp.asarray(scale), 0))
    x_int16 = np.rint(x * (np.float32(32767) / 3.0)).astype(np.int64)  # every |x| is the row's peak: +-32767
    sums = x_int16 @ w.T.astype(np.int64)
    assert np.abs(sums).max() > 2**31, "the case must reach past int32"
    want = sums.astype(np.float32) * (np.float32(3.0) / np.float32(32767)) * scale  # as the kernel scales
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@needs_kernel
def test_kernel_refuses_a_layer_outside_the_stack():
    w = jnp.zeros((2, 8, 16), jnp.float32)
    with pytest.raises(Exception, match="layer 2 out of range"):
        jax.block_until_ready(few_rows_matmul(jnp.zeros((1, 16)), w, None, 2))


# The most rows any weight type streams before its register blocks, on any CPU (int8 without AVX-512:
# streamed_rows in few_rows_matmul.cc).
MOST_STREAMED_ROWS = 64


@needs_kernel
@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_padding_rows_past_the_live_ones_are_skipped_and_the_live_ones_unchanged(kind):
    """A step's token bucket pads its rows; the kernel multiplies only the first `live_rows` (zeros for the
    others). Many rows (72, 300: register blocks, chunks of them, live counts that end mid-block) come out the
    same to the last bit as when every row is multiplied; few rows (5, streamed) are grouped into passes by
    the live count, so their float32 sums may round in another order."""
    rng = np.random.default_rng(11)
    k = 256 if kind in GGUF_KINDS else 48
    w, scale, _ = _weights(rng, 37, k, kind)
    formats = (kind,) if kind in GGUF_KINDS else None
    matmul_of = jax.jit(few_rows_matmul, static_argnames="formats")
    for rows, live_counts in ((5, (0, 1, 3)), (72, (1, 17, 39)), (300, (13, 257, 299))):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        every_row = np.asarray(matmul_of(x, w, scale, 0, formats))
        for live in (*live_counts, rows):
            got = np.asarray(matmul_of(x, w, scale, 0, formats, np.int32(live)))
            if rows > MOST_STREAMED_ROWS:
                np.testing.assert_array_equal(got[:live], every_row[:live])
            else:
                np.testing.assert_allclose(got[:live], every_row[:live], rtol=1e-6, atol=1e-5)
            assert not got[live:].any(), f"{kind}: padding rows past {live} of {rows} were multiplied"


@needs_kernel
def test_kernel_refuses_more_live_rows_than_it_has():
    with pytest.raises(Exception, match=r"live rows 3 out of range \[0, 2\]"):
        jax.block_until_ready(few_rows_matmul(jnp.zeros((2, 16)), jnp.zeros((8, 16)), live_rows=np.int32(3)))


@settings(max_examples=30)
@given(kind=st.sampled_from(GGUF_KINDS), seed=st.integers(0, 2**16))
def test_gguf_blocks_dequantize_as_gguf_does(kind, seed):
    """Bit for bit, over random blocks (K-quants: every bit random but their float16 scales); rows of two blocks,
    one shape per format so that each compiles once."""
    in_features = 2 * FORMATS[kind][0]
    raw, _, exact = _weights(np.random.default_rng(seed), 8, in_features, kind)
    got = jax.jit(dequantize_blocks, static_argnums=(1, 2))(raw, kind, in_features)
    np.testing.assert_array_equal(np.asarray(got), exact.astype(np.float32))


def test_gguf_rows_too_narrow_for_their_format_are_refused():
    raw, _, _ = _weights(np.random.default_rng(2), 3, 256, "q4_0")  # 144 bytes a row: as wide as Q4_K's
    with pytest.raises(ValueError, match="cannot hold 256 weights in q5_k"):
        dequantize_blocks(raw, "q5_k", 256)
    with pytest.raises(ValueError, match="a q4_k row holds a multiple of 256 weights, not 96"):
        dequantize_blocks(raw, "q4_k", 96)


@pytest.mark.parametrize("kind", ["q4_0", "q5_0", "q8_0"])
def test_q4_0_and_q5_0_rows_become_the_same_weights_in_q8_0(kind):
    """A fused matrix of Q5_0 and Q8_0 tensors (Gemma 3's q, k and v) is kept as Q8_0: exactly the same weights."""
    raw, _, exact = _weights(np.random.default_rng(3), 5, 128, kind)
    widened = as_q8_0(np.asarray(raw), kind, 128)
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(jnp.asarray(widened), "q8_0", 128)),
                                  exact.astype(np.float32))
    with pytest.raises(ValueError, match="q4_1 blocks are no Q8_0 blocks"):
        as_q8_0(np.asarray(_weights(np.random.default_rng(3), 5, 128, "q4_1")[0]), "q4_1", 128)


@needs_kernel
def test_kernel_refuses_uint8_rows_of_no_block_format():
    with pytest.raises(Exception, match="uint8 rows of 30 bytes hold no 64 weights of ggml_type 2"):
        jax.block_until_ready(few_rows_matmul(jnp.zeros((1, 64)), jnp.zeros((4, 30), jnp.uint8), formats=("q4_0",)))
    with pytest.raises(Exception, match="name one ggml_type per layer"):
        jax.block_until_ready(few_rows_matmul(jnp.zeros((1, 64)), jnp.zeros((4, 36), jnp.uint8)))


@pytest.mark.parametrize("rows, many_rows_kernel", [(1, True), (70, True), (70, False)])
def test_a_stack_of_layers_in_different_formats(rows, many_rows_kernel, monkeypatch):
    """A Q4_K_M file's ffn_down is Q4_K in some layers and Q6_K in others: the stack keeps each layer's blocks,
    the narrower rows padded, and each layer is multiplied as its own format, by the kernel (few rows, and many
    with AVX-512) and by XLA's dot of the layer dequantized (lax.switch: many rows without AVX-512)."""
    monkeypatch.setattr(matmul, "MANY_ROWS_KERNEL", matmul.MANY_ROWS_KERNEL and many_rows_kernel)
    rng = np.random.default_rng(4)
    kinds = ("q4_k", "q6_k", "q4_k")
    layers = [_weights(rng, 8, 512, kind) for kind in kinds]
    width = max(raw.shape[1] for raw, _, _ in layers)
    stack = jnp.stack([jnp.pad(raw, ((0, 0), (0, width - raw.shape[1])), constant_values=0xFF)
                       for raw, _, _ in layers])  # padding bytes that would show if they were read
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    multiplied, _ = _rows_rounded_to_int16(x)
    call = jax.jit(lambda x, layer: linear(x, stack, layer=layer, formats=kinds))  # traced with this test's routing
    for layer, (_, _, exact) in enumerate(layers):
        got = np.asarray(call(x, jnp.int32(layer)))
        np.testing.assert_allclose(got, multiplied @ exact.T, rtol=0, atol=1e-5 * np.sqrt(512) * np.abs(exact).max())


@needs_kernel
def test_int8_weights_of_a_width_the_kernel_refuses_take_xla_with_the_same_rounding():
    rng = np.random.default_rng(1)
    w, scale, exact = _weights(rng, 8, 24, "int8")  # 24 inputs: not a multiple of 16
    with pytest.raises(Exception, match="K a multiple of 16"):
        jax.block_until_ready(few_rows_matmul(jnp.zeros((1, 24)), w, scale))
    assert not uses_few_rows_kernel(1, w)
    x = rng.standard_normal((1, 24)).astype(np.float32)
    multiplied, _ = _rows_rounded_to_int16(x)
    np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, w, scale)), multiplied @ exact.T, rtol=0, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_linear_takes_the_kernel_for_few_rows_and_xla_beyond_with_the_same_result(kind, monkeypatch):
    """At the kernel's row limit and one past it, a single matrix: XLA's dot past the limit, except that with
    AVX-512 the kernel keeps every weight but float32 for any rows (matmul.MANY_ROWS_KERNEL); then XLA's path
    (forced) gives the kernel's result."""
    rng = np.random.default_rng(0)
    k = 256 if kind in K_QUANTS else 64
    w, scale, _ = _weights(rng, 96, k, kind)
    formats = (kind,) if kind in GGUF_KINDS else None
    limit = GGUF_FEW_ROWS if formats else FEW_ROWS[w.dtype.itemsize]
    assert uses_few_rows_kernel(limit, w)
    assert uses_few_rows_kernel(limit + 1, w) == (matmul.MANY_ROWS_KERNEL and kind != "float32")
    x = rng.standard_normal((limit + 1, k)).astype(np.float32)
    few = np.asarray(jax.jit(lambda x: linear(x, w, scale, formats=formats))(x[:limit]))  # the kernel
    monkeypatch.setattr(matmul, "MANY_ROWS_KERNEL", False)
    many = np.asarray(jax.jit(lambda x: linear(x, w, scale, formats=formats))(x))  # traced now: XLA's dot
    np.testing.assert_allclose(few, many[:limit], rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("kind, k", [("float32", 48), ("float32", 40), ("bfloat16", 48), ("int8", 48), ("q4_1", 64),
                                     ("q6_k", 256)])
def test_a_layer_of_a_stack_takes_the_kernel_for_any_rows(kind, k):
    """Past FEW_ROWS rows a float32 stack's layer, and narrower weights, are multiplied by the kernel's
    register blocks (where the CPU has AVX-512), read in place: 600 rows are three chunks of 256, the last of 88
    (two panels and a partial one), and 100 output features leave tails after the blocks of 12. x's panels are
    packed by 16 x 16 transposes, and (40 inputs) one value at a time."""
    rng = np.random.default_rng(k)
    stack = [_weights(rng, 100, k, kind) for _ in range(3)]
    w = jnp.stack([stored for stored, _, _ in stack])
    scale = jnp.stack([s for _, s, _ in stack]) if kind == "int8" else None
    formats = (kind,) * 3 if kind in GGUF_KINDS else None
    assert uses_few_rows_kernel(600, w) == matmul.MANY_ROWS_KERNEL
    assert not uses_few_rows_kernel(FEW_ROWS[4] + 1, jnp.ones((100, k)))  # one float32 matrix: no copy to save
    x = rng.standard_normal((600, k)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x: linear(x, w, scale, layer=jnp.int32(1), formats=formats))(x))
    multiplied, _ = _rows_rounded_to_int16(x) if kind in ROUNDS_X else (x.astype(np.float64), None)
    exact = stack[1][2]
    float32_rounding = 1e-5 * np.sqrt(k) * max(1.0, np.abs(exact).max())  # as in the first test
    np.testing.assert_allclose(got, multiplied @ exact.T, rtol=0, atol=float32_rounding)


def test_int8_rows_in_place_equal_the_plain_formula_and_quantize_layer_by_layer():
    """int8_rows (start-up's in-place passes) gives the plain formula's bits, and a stack of layers quantized one
    by one (as models/weights.py does) equals the stack quantized at once: rows are independent."""
    from jax_engine.linear.quantization import int8_rows

    w = np.random.default_rng(2).standard_normal((3, 64, 96)).astype(np.float32) * np.float32(0.02)
    w[1, 5] = 0.0
    scale = np.where(np.abs(w).max(-1) > 0, np.abs(w).max(-1) / 127.0, 1.0).astype(np.float32)
    plain = np.clip(np.rint(w / scale[..., None]), -127, 127).astype(np.int8)
    q, got_scale = int8_rows(w)
    assert np.array_equal(q, plain) and np.array_equal(got_scale, scale)
    layers = [int8_rows(layer) for layer in w]
    assert np.array_equal(np.stack([lq for lq, _ in layers]), q)
    assert np.array_equal(np.stack([ls for _, ls in layers]), scale)


def test_int8_rows_round_to_within_half_a_step_of_their_scale():
    w = np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)
    w[3] = 0.0  # an all-zero row keeps a finite scale
    q, scale = (np.asarray(a) for a in quantize(w, "int8", jnp.float32))
    assert q.dtype == np.int8 and np.abs(q).max() == 127 and np.isfinite(scale).all()
    assert (np.abs(q * scale[:, None] - w) <= scale[:, None] / 2 + 1e-7).all()
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        quantize(w, "int4", jnp.float32)


TEXT = ("The lighthouse keeper climbed the stairs every evening, counting the steps as his father had, and lit "
        "the lamp before the fishing boats came home across the bay.")


@pytest.mark.parametrize("quantization, max_mean_diff, min_top1", [("bf16", 0.05, 0.95), ("int8", 0.35, 0.8),
                                                                   ("gguf", 0.01, 0.99)])
def test_quantized_weights_stay_close_to_float32(default_checkpoint, quantization, max_mean_diff, min_top1):
    """Next-token logits at every position of a fixed text, SmolLM2 with quantized weights vs float32.

    Measured (logits span ~30): bf16 mean |diff| 0.022, top-1 agreement 1.000; int8 0.270, 0.871; gguf 0.0046,
    1.000 (float32 is the same file's blocks dequantized: only x's rounding to 16 bits differs). The inputs
    are fixed, so the bounds only leave room for other summation orders (kernel vs XLA, thread counts), not
    for a broken dequantization (int8 weights read as unscaled integers give logits off by hundreds).
    """
    ids = default_checkpoint.tokenizer.encode(TEXT)
    exact = engine_logits(default_checkpoint, ids, [len(ids)], block_size=16)
    quantized = engine_logits(default_checkpoint, ids, [len(ids)], block_size=16, quantization=quantization)
    mean_diff = np.abs(quantized - exact).mean()
    top1 = (quantized.argmax(-1) == exact.argmax(-1)).mean()
    print(f"{quantization}: mean |diff| {mean_diff:.4f}, top-1 agreement {top1:.3f}")
    assert 0 < mean_diff < max_mean_diff and top1 >= min_top1


def test_gguf_quantization_needs_a_gguf_file(tiny_checkpoint_dir):
    from jax_engine import LLM

    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's .* has none"):
        LLM(model=tiny_checkpoint_dir, quantization="gguf", enforce_eager=True)


@pytest.fixture(scope="module")
def float32_quality(make_llm):
    from jax_engine.bench.quality import greedy_tokens, perplexity

    llm = make_llm(max_model_len=512, max_num_seqs=8)
    return perplexity(llm), greedy_tokens(llm, 32)


# Measured by `jax-engine bench quality` (docs/benchmarks.md): perplexity 29.498 float32, 29.472 bf16, 29.318
# int8; leading greedy tokens equal to float32's over 8 prompts x 32 tokens, mean 28.4 bf16 and 20.1 int8.
# gguf: 29.498 and 32 of 32 (float32 is the same blocks dequantized; only x's rounding to 16 bits differs).
@pytest.mark.parametrize("quantization, max_perplexity_change, min_mean_agreement", [("bf16", 0.01, 24),
                                                                                     ("int8", 0.05, 14),
                                                                                     ("gguf", 0.001, 30)])
def test_quantized_perplexity_and_greedy_agreement(make_llm, float32_quality, quantization, max_perplexity_change,
                                                   min_mean_agreement):
    """The quality benchmark's figures, bounded: a wrong scale or a lost row moves perplexity by far more than
    5%, and breaks greedy agreement at the first token."""
    from jax_engine.bench.quality import greedy_tokens, leading_agreement, perplexity

    exact_perplexity, exact_greedy = float32_quality
    llm = make_llm(max_model_len=512, max_num_seqs=8, quantization=quantization)
    change = abs(perplexity(llm) / exact_perplexity - 1)
    agreement = [leading_agreement(o, r) for o, r in zip(greedy_tokens(llm, 32), exact_greedy)]
    assert change < max_perplexity_change and np.mean(agreement) >= min_mean_agreement, (change, agreement)
