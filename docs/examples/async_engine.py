"""AsyncLLMEngine: many coroutines generate at once and share the engine's steps (continuous batching)."""

import asyncio

from jax_engine import AsyncLLMEngine, EngineArgs, SamplingParams


async def ask(engine: AsyncLLMEngine, request_id: str, prompt: str, max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    async for output in engine.generate(prompt, params, request_id):  # one RequestOutput per step it progressed
        if output.finished:
            print(f"{request_id}: {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")


async def main() -> None:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=512))
    await asyncio.gather(ask(engine, "short", "The capital of France is", 4),
                         ask(engine, "long", "Once upon a time", 24))
    print("steps:", engine.engine.num_steps, "for", 4 + 24, "tokens")
    await engine.stop()


asyncio.run(main())
