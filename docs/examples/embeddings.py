"""Embeddings (task="embed"): one vector per prompt, here the mean of the default
model's final hidden states."""

import numpy as np

from jax_engine import LLM, PoolingParams

llm = LLM(task="embed", pooler_config={"pooling_type": "MEAN"}, enforce_eager=True)
texts = ["The cat sat on the mat.", "A kitten slept on the rug.",
         "Stock markets fell sharply today.", "Shares dropped at the close of trading."]
outputs = llm.embed(texts, use_tqdm=False)
vectors = np.array([o.outputs.embedding for o in outputs])  # unit length: normalized
print("vectors:", vectors.shape, "norms:", np.linalg.norm(vectors, axis=1).round(3))
print("cosine similarity:")
for text, row in zip(texts, vectors @ vectors.T):
    print("  " + " ".join(f"{s:.2f}" for s in row), text)
short = llm.embed(texts[0], PoolingParams(dimensions=64), use_tqdm=False)[0]
print("dimensions=64:", len(short.outputs.embedding), "values")
