"""GGUF files of the families outside Llama's layout (GPT-NeoX, StarCoder, Falcon, BLOOM, MPT, GPT-2), written here
as llama.cpp's converter (convert_hf_to_gguf.py) writes them from a tiny HF checkpoint, then loaded and compared
with the HF model they came from, logits position by position (as test_gguf_families.py does for Llama's layout).

The writer below does the converter's rearrangements in the converter's direction (its fused-QKV reordering, GPT-2's
transposes), so a wrong inverse in the loader shows in the logits. The files hold only the keys the converter
writes: the loader's defaults for the others are part of what is tested.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from jax_engine.loader import load_checkpoint
from tests.test_gguf_families import byte_level_fields, logit_diff
from tests.tiny_checkpoints import make_tiny_checkpoint

# HF module -> GGUF module, as gguf-py's tensor_mapping.py maps them (the layer part after the layer prefix).
NEOX = {"input_layernorm": "attn_norm", "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
GPT2 = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
        "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
GPT2_GLOBALS = {"transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm"}
FALCON = {"input_layernorm": "attn_norm", "ln_mlp": "attn_norm", "ln_attn": "attn_norm_2",  # llama.cpp's 40B names
          "self_attention.query_key_value": "attn_qkv", "self_attention.dense": "attn_output",
          "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
BLOOM = {**FALCON, "post_attention_layernorm": "ffn_norm"}
MPT = {"norm_1": "attn_norm", "attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "norm_2": "ffn_norm",
       "ffn.up_proj": "ffn_up", "ffn.down_proj": "ffn_down"}
Q8_0 = GGMLQuantizationType.Q8_0
# A LayerNorm epsilon far from the RMS one the Llama-style files have (1e-6): reading the wrong key shows.
EPS = 1e-3


def converted(hf_model, prefix: str, layers: dict[str, str], top: dict[str, str], modify=None) -> dict:
    """The HF model's tensors under the converter's names, after `modify(name, array)` (its modify_tensors)."""
    tensors = {}
    for name, value in hf_model.state_dict().items():
        if name == "lm_head.weight" and hf_model.config.tie_word_embeddings:
            continue  # the safetensors files hold a tied head once, as the embedding
        module, kind = name.rsplit(".", 1)
        array = value.numpy() if modify is None else modify(name, value.numpy())
        if module.startswith(prefix):
            layer, module = module.removeprefix(prefix).split(".", 1)
            tensors[f"blk.{layer}.{layers[module]}.{kind}"] = array
        else:
            tensors[f"{top[module]}.{kind}"] = array
    return tensors


def write_converted(path, architecture: str, hparams: dict, tensors: dict[str, np.ndarray], q8_0: bool = False) -> str:
    """A GGUF file with just these hyper-parameters (under `architecture.`), the tiny vocabulary and tensors (its
    matrices in Q8_0 blocks when `q8_0`)."""
    writer = GGUFWriter(str(path), architecture)
    for key, value in [*((f"{architecture}.{k}", v) for k, v in hparams.items()), *byte_level_fields().items()]:
        add = {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}
        add.get(type(value), writer.add_array)(key, value)
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if q8_0 and array.ndim == 2:
            writer.add_tensor(name, quantize(array, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def sizes(layers: int, context: int, hidden: int, heads: int, eps: float, **more) -> dict:
    return {"block_count": layers, "context_length": context, "embedding_length": hidden,
            "feed_forward_length": 4 * hidden, "attention.head_count": heads, "attention.layer_norm_epsilon": eps,
            **more}


def check(path: str, hf_model, label: str):
    checkpoint = load_checkpoint(path)
    diff = logit_diff(checkpoint, hf_model)
    print(f"{label} GGUF vs HF: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5  # float32 sums in another order
    return checkpoint


def per_head_to_gguf(name: str, w: np.ndarray, n_head: int) -> np.ndarray:
    """The GPT-NeoX and BLOOM converters: query_key_value's rows per head (q, k, v) -> all q, all k, all v."""
    if "query_key_value" not in name:
        return w
    per_head = w.reshape(n_head, 3, -1, *w.shape[1:])
    return np.concatenate([per_head[:, i].reshape(-1, *w.shape[1:]) for i in range(3)])


def neox_file(tmp_path, q8_0: bool = False) -> tuple[str, object]:
    """A GPT-NeoX file as the converter writes it, and the HF model it came from."""
    hf_model = make_tiny_checkpoint(tmp_path, "gpt_neox", layer_norm_eps=EPS)
    cfg = hf_model.config
    tensors = converted(hf_model, "gpt_neox.layers.", NEOX, {"gpt_neox.embed_in": "token_embd",
                                                             "gpt_neox.final_layer_norm": "output_norm",
                                                             "embed_out": "output", "lm_head": "output"},
                        lambda name, w: per_head_to_gguf(name, w, cfg.num_attention_heads))
    rotary = int(cfg.rope_parameters["partial_rotary_factor"] * cfg.hidden_size // cfg.num_attention_heads)
    hparams = sizes(cfg.num_hidden_layers, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_attention_heads,
                    EPS, **{"rope.dimension_count": rotary, "use_parallel_residual": cfg.use_parallel_residual})
    hparams["feed_forward_length"] = cfg.intermediate_size
    return write_converted(tmp_path / "neox.gguf", "gptneox", hparams, tensors, q8_0), hf_model


def test_a_gptneox_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path):
    """Partial rotation (rope.dimension_count), parallel residual, an LM head of its own, per-head fused QKV."""
    path, hf_model = neox_file(tmp_path)
    checkpoint = check(path, hf_model, "GPT-NeoX")
    head_dim = hf_model.config.hidden_size // hf_model.config.num_attention_heads
    assert (checkpoint.config.rotary_dim, checkpoint.config.parallel_residual) == (head_dim // 2, True)


def gpt2_file(tmp_path, model_type: str, q8_0: bool = False) -> tuple[str, object]:
    """A GPT-2 or StarCoder (gpt_bigcode) file as the converter writes it, and the HF model it came from."""
    hf_model = make_tiny_checkpoint(tmp_path, model_type, layer_norm_epsilon=EPS)
    cfg = hf_model.config

    def transpose_conv1d(name: str, w: np.ndarray) -> np.ndarray:  # GPT2Model.modify_tensors
        return w.T if model_type == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else w

    tensors = converted(hf_model, "transformer.h.", GPT2, GPT2_GLOBALS, transpose_conv1d)
    more = {"attention.head_count_kv": 1} if model_type == "gpt_bigcode" else {}
    hparams = sizes(cfg.n_layer, cfg.n_positions, cfg.n_embd, cfg.n_head, EPS, **more)
    arch = "gpt2" if model_type == "gpt2" else "starcoder"
    return write_converted(tmp_path / f"{arch}.gguf", arch, hparams, tensors, q8_0), hf_model


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_bigcode"])
def test_a_gpt2_or_starcoder_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path, model_type):
    """Learned positions; GPT-2's Conv1D matrices, which its converter writes transposed; StarCoder's multi-query
    attention (one key and one value head)."""
    path, hf_model = gpt2_file(tmp_path, model_type)
    checkpoint = check(path, hf_model, model_type)
    assert checkpoint.config.num_kv_heads == (1 if model_type == "gpt_bigcode" else hf_model.config.n_head)


def test_raw_blocks_are_kept_where_whole_rows_move_and_dropped_where_a_transpose_mixes_them(tmp_path):
    """Q8_0 files: GPT-NeoX's regrouped QKV keeps its raw block rows, regrouped as its float rows are; GPT-2's
    transposed matrices keep none (each block holds part of a row of the file's transpose)."""
    checkpoint = load_checkpoint(neox_file(tmp_path / "neox", q8_0=True)[0])
    qkv = "gpt_neox.layers.0.attention.query_key_value.weight"
    assert checkpoint.blocks[qkv].format == "q8_0"
    np.testing.assert_array_equal(dequantize(checkpoint.blocks[qkv].rows, Q8_0), checkpoint.weights[qkv])
    checkpoint = load_checkpoint(gpt2_file(tmp_path / "gpt2", "gpt2", q8_0=True)[0])
    assert "transformer.wte.weight" in checkpoint.blocks and "transformer.h.0.mlp.c_fc.weight" not in checkpoint.blocks
    assert checkpoint.weights["transformer.h.0.mlp.c_fc.weight"].shape == (64, 256)  # HF's Conv1D [in, out]


def falcon_to_gguf(name: str, w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """FalconModel.modify_tensors: n_head_kv groups of (n_head / n_head_kv queries, a key, a value) -> all q, all
    k, all v."""
    if "query_key_value" not in name:
        return w
    rest = w.shape[1:]
    qkv = w.reshape(n_head_kv, n_head // n_head_kv + 2, -1, *rest)
    q, k, v = qkv[:, :-2].reshape(-1, *rest), qkv[:, [-2]].reshape(-1, *rest), qkv[:, [-1]].reshape(-1, *rest)
    return np.concatenate([q, k, v])


# 40B-style: grouped-query attention (2 KV heads) and two norms a layer; 7B-style: multi-query, one norm.
FALCON_CASES = {"40b": dict(new_decoder_architecture=True, num_kv_heads=2),
                "7b": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, num_kv_heads=None)}


@pytest.mark.parametrize("case", FALCON_CASES)
def test_a_falcon_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path, case):
    hf_model = make_tiny_checkpoint(tmp_path, "falcon", layer_norm_epsilon=EPS, **FALCON_CASES[case])
    cfg = hf_model.config
    kv_heads = cfg.num_kv_heads if cfg.new_decoder_architecture else 1
    tensors = converted(hf_model, "transformer.h.", FALCON, {"transformer.word_embeddings": "token_embd",
                                                             "transformer.ln_f": "output_norm", "lm_head": "output"},
                        lambda name, w: falcon_to_gguf(name, w, cfg.num_attention_heads, kv_heads))
    assert ("blk.0.attn_norm_2.weight" in tensors) == (case == "40b")
    hparams = sizes(cfg.num_hidden_layers, 2048, cfg.hidden_size, cfg.num_attention_heads, EPS,
                    **{"attention.head_count_kv": kv_heads, "tensor_data_layout": "jploski"})
    checkpoint = check(write_converted(tmp_path / "falcon.gguf", "falcon", hparams, tensors), hf_model, f"Falcon {case}")
    assert checkpoint.config.num_kv_heads == kv_heads


def test_a_bloom_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path):
    """ALiBi (6 heads: not a power of two), the embedding LayerNorm, per-head fused QKV, the head written out."""
    hf_model = make_tiny_checkpoint(tmp_path, "bloom", layer_norm_epsilon=EPS)
    cfg = hf_model.config
    top = {"transformer.word_embeddings": "token_embd", "transformer.word_embeddings_layernorm": "token_embd_norm",
           "transformer.ln_f": "output_norm"}
    tensors = converted(hf_model, "transformer.h.", BLOOM, top, lambda name, w: per_head_to_gguf(name, w, cfg.n_head))
    tensors["output.weight"] = tensors["token_embd.weight"]  # BloomModel.modify_tensors: a tied head duplicated
    hparams = sizes(cfg.n_layer, cfg.to_dict().get("seq_length", cfg.hidden_size), cfg.hidden_size, cfg.n_head, EPS,
                    **{"attention.head_count_kv": cfg.n_head})
    checkpoint = check(write_converted(tmp_path / "bloom.gguf", "bloom", hparams, tensors), hf_model, "BLOOM")
    assert checkpoint.config.position_embedding == "alibi"


def test_an_mpt_gguf_gives_the_logits_of_its_hf_checkpoint(tmp_path):
    """ALiBi with the file's max_alibi_bias; norms without biases; Wqkv is q, k, v already."""
    hf_model = make_tiny_checkpoint(tmp_path, "mpt")  # transformers' MPT takes alibi_bias_max as 8, whatever it says
    cfg = hf_model.config
    tensors = converted(hf_model, "transformer.blocks.", MPT, {"transformer.wte": "token_embd",
                                                               "transformer.norm_f": "output_norm"})
    hparams = sizes(cfg.n_layers, cfg.max_seq_len, cfg.d_model, cfg.n_heads, 1e-5,  # the converter's fixed eps
                    **{"attention.max_alibi_bias": float(cfg.attn_config.alibi_bias_max)})
    checkpoint = check(write_converted(tmp_path / "mpt.gguf", "mpt", hparams, tensors), hf_model, "MPT")
    assert checkpoint.config.alibi_slopes[0] == pytest.approx(2 ** -2)  # 2^(-8 / 4 heads): the file's bias max


def test_an_mpt_gguf_with_clamped_qkv_is_refused(tmp_path):
    hf_model = make_tiny_checkpoint(tmp_path, "mpt")
    cfg = hf_model.config
    tensors = converted(hf_model, "transformer.blocks.", MPT, {"transformer.wte": "token_embd",
                                                               "transformer.norm_f": "output_norm"})
    hparams = sizes(cfg.n_layers, cfg.max_seq_len, cfg.d_model, cfg.n_heads, 1e-5,
                    **{"attention.max_alibi_bias": 8.0, "attention.clamp_kqv": 6.0})
    with pytest.raises(ValueError, match="clamp_kqv"):
        load_checkpoint(write_converted(tmp_path / "mpt.gguf", "mpt", hparams, tensors))
