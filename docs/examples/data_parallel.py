"""Data parallelism: two replicas of the model, each on its own device, one front."""

import os

# CPU only: split this machine into 2 JAX devices before JAX starts (GPUs are devices).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import asyncio  # noqa: E402

from jax_engine import EngineArgs, SamplingParams  # noqa: E402
from jax_engine.server.data_parallel import DataParallelEngine  # noqa: E402

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time",
           "Water boils at"]


async def answer(engine: DataParallelEngine, request_id: str, prompt: str) -> str:
    params = SamplingParams(temperature=0, max_tokens=6)
    async for output in engine.generate(prompt, params, request_id):
        pass
    return output.outputs[0].text


async def main() -> None:
    # What `jax-engine serve --data-parallel-size 2` builds (the checkpoint loads once).
    # enforce_eager: a few short requests, so compile on first use.
    args = EngineArgs(data_parallel_size=2, max_model_len=256, max_num_seqs=4,
                      enforce_eager=True)
    engine = DataParallelEngine.from_engine_args(args)
    engine.start()
    texts = await asyncio.gather(*(answer(engine, f"request-{i}", prompt)
                                   for i, prompt in enumerate(PROMPTS)))
    await engine.stop()
    for prompt, text in zip(PROMPTS, texts):
        print(f"{prompt!r} -> {text!r}")
    for r, replica in enumerate(engine.replicas):
        [device] = replica.engine.runner.k_cache.devices()
        print(f"replica {r}: KV cache on {device}, {replica.engine.num_steps} steps")


asyncio.run(main())
