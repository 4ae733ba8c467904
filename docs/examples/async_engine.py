"""AsyncLLMEngine: many coroutines generate at once and share the engine's steps."""

import asyncio
import textwrap

from jax_engine import AsyncLLMEngine, EngineArgs, SamplingParams


async def ask(engine: AsyncLLMEngine, request_id: str, prompt: str,
              max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    # One RequestOutput each step that made progress on this request; print the last.
    async for output in engine.generate(prompt, params, request_id):
        if output.finished:
            completion = output.outputs[0]
            print(f"{request_id} ({completion.finish_reason}):")
            print(textwrap.fill(repr(completion.text), width=80, initial_indent="    ",
                                subsequent_indent="    "))


async def main() -> None:
    # Two short requests: compile the shapes they meet on first use.
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=1024,
                                                        enforce_eager=True))
    await asyncio.gather(ask(engine, "short", "The capital of France is", 4),
                         ask(engine, "long", "Once upon a time", 24))
    num_steps = engine.engine.num_steps
    print("steps:", num_steps, "for", 4 + 24, "tokens")
    await engine.stop()
    # Continuous batching: the short request's tokens rode in the long one's steps.
    assert num_steps < 4 + 24


asyncio.run(main())
