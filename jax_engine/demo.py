"""`make demo`: greedy generations of the default model for a few chat prompts.

Until the JAX engine lands this runs the NumPy reference engine, which is slow but exact.
"""

import time

from jax_engine.loader import load_checkpoint
from reference import LlamaModel, ReferenceEngine, SamplingParams, SchedulerConfig

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]


def main() -> None:
    started = time.perf_counter()
    checkpoint = load_checkpoint()
    print(f"Loaded SmolLM2-135M-Instruct in {time.perf_counter() - started:.1f} s")
    engine = ReferenceEngine(
        LlamaModel(checkpoint.config, checkpoint.weights),
        num_blocks=128,
        scheduler_config=SchedulerConfig(max_model_len=512, max_num_batched_tokens=512),
        eos_token_ids=checkpoint.config.eos_token_ids,
        tokenizer=checkpoint.tokenizer,
    )
    prompts = [
        checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    started = time.perf_counter()
    generations = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
    elapsed = time.perf_counter() - started
    for question, generation in zip(QUESTIONS, generations):
        print(f"\n>>> {question}\n{generation.text.strip()}")
    num_tokens = sum(len(g.output_token_ids) for g in generations)
    print(f"\n{num_tokens} tokens in {elapsed:.1f} s with the NumPy reference engine ({len(engine.trace)} steps)")


if __name__ == "__main__":
    main()
