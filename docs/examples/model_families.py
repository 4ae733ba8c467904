"""Any family in docs/models.md loads from a checkpoint directory: here a tiny
random GPT-2 that transformers writes in bfloat16, sharded, as large releases
come. No download: the weights and a one-token-per-byte tokenizer are made here."""

import tempfile

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from jax_engine import LLM, SamplingParams

directory = tempfile.mkdtemp()
torch.manual_seed(0)
config = GPT2Config(vocab_size=257, n_embd=64, n_layer=2, n_head=4,
                    n_positions=128, eos_token_id=256)
model = GPT2LMHeadModel(config).to(torch.bfloat16)
model.save_pretrained(directory, max_shard_size="100KB")

byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
vocab = {t: i for i, t in enumerate(sorted(byte_level.alphabet()) + ["<eos>"])}
tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
tokenizer.pre_tokenizer, tokenizer.decoder = byte_level, decoders.ByteLevel()
PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(
    directory)

llm = LLM(directory, max_model_len=128, enforce_eager=True)
cfg = llm.llm_engine.model_config
print(cfg.architecture, cfg.position_embedding, cfg.norm)
params = SamplingParams(temperature=0, max_tokens=8)
[output] = llm.generate("Hello", params, use_tqdm=False)
print(output.outputs[0].token_ids)
