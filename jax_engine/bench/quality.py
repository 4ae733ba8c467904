"""Quality of quantized weights against float32: perplexity on a fixed text and greedy agreement.

Perplexity is exp(-mean log p(token | the text before it)) over the fixed text below, from the engine's
prompt logprobs. Greedy agreement generates --output-len tokens greedily from each of a few prompts and
counts how many leading tokens equal float32's (a greedy run diverges for good at its first different
token, so the leading run is the honest figure).
"""

import argparse
import math

from jax_engine.config import EngineArgs

FIXED_ENGINE_ARGS = ("quantization", "max_model_len")
TEXT = (
    "The town stood where the river met the sea, and for three hundred years its people had lived by both. "
    "In the mornings the fishing boats went out past the breakwater, and in the evenings the barges came down "
    "from the hills with timber, wool and grain. The market square was paved with stones that had been "
    "carried from a quarry two days away, and the clock on the town hall had been wound by the same family "
    "for six generations. Children learned to swim before they could read, and every house kept a lantern "
    "by the door in case the fog came in. When the railway arrived, the barges grew fewer and the harbour "
    "filled with pleasure boats, but the fishermen still went out each morning, and the clock still struck "
    "the hours, a little late, as it always had. Visitors said the town was charming; the people who lived "
    "there said it was home, which is not the same thing, and is worth more.")
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "Three tips for staying healthy are", "The history of the printing press", "Once upon a time,",
           "Explain photosynthesis to a child:", "List the planets of the solar system:"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantizations", nargs="+", default=["bf16", "int8", "gguf"],
                        help="formats to set against float32 (gguf: a .gguf model's blocks as the file has them)")
    parser.add_argument("--output-len", type=int, default=32, help="greedy tokens per prompt")
    EngineArgs.add_cli_args(parser, exclude=FIXED_ENGINE_ARGS)


def perplexity(llm) -> float:
    from jax_engine import SamplingParams

    [out] = llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ids = out.prompt_token_ids
    logprobs = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy_tokens(llm, output_len: int) -> list[list[int]]:
    from jax_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def leading_agreement(ours: list[int], reference: list[int]) -> int:
    """How many leading tokens are equal."""
    return next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))


def measure(args: argparse.Namespace, checkpoint, quantization: str | None, output_len: int) -> dict:
    from jax_engine import LLM, LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args, quantization=quantization, max_model_len=512),
                       checkpoint=checkpoint)
    llm = LLM.from_engine(engine)
    return {"perplexity": perplexity(llm), "greedy": greedy_tokens(llm, output_len)}


def main(args: argparse.Namespace) -> dict:
    from jax_engine.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model)
    reference = measure(args, checkpoint, None, args.output_len)
    print(f"{'weights':<9} {'perplexity':>10}  {'leading greedy tokens equal to float32, per prompt':<50}")
    print(f"{'float32':<9} {reference['perplexity']:>10.3f}")
    report = {"float32": reference}
    for quantization in args.quantizations:
        result = measure(args, checkpoint, quantization, args.output_len)
        result["agreement"] = [leading_agreement(o, r) for o, r in zip(result["greedy"], reference["greedy"])]
        mean = sum(result["agreement"]) / len(result["agreement"])
        print(f"{quantization:<9} {result['perplexity']:>10.3f}  {result['agreement']} (mean {mean:.1f} of "
              f"{args.output_len})")
        report[quantization] = result
    return report
