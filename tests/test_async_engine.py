"""AsyncLLMEngine: concurrent callers share steps, get what LLM.generate gives, and can leave at any time."""

import asyncio

import pytest

from jax_engine import EngineArgs, LLMEngine, SamplingParams
from jax_engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from jax_engine.llm import LLM

ARGS = dict(num_gpu_blocks_override=64, block_size=8, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
            enforce_eager=True)
PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109], [42] * 20, [7, 9], [200, 3, 4, 5, 6]]


def _engine(checkpoint, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(**{**ARGS, **kwargs}), checkpoint=checkpoint)


def _free_blocks(engine: AsyncLLMEngine) -> int:
    return engine.engine.scheduler.kv.device.num_free_blocks


def test_concurrent_generate_equals_llm_generate(tiny_checkpoint):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True, n=2)]
    expected = LLM.from_engine(_engine(tiny_checkpoint)).generate(PROMPTS * 2, [params[0]] * 5 + [params[1]] * 5,
                                                                  use_tqdm=False)

    async def run():
        engine = AsyncLLMEngine(_engine(tiny_checkpoint))
        steps_before = engine.engine.num_steps

        async def one(i: int):
            *_, final = [o async for o in engine.generate(PROMPTS[i % 5], params[i // 5], f"req-{i}")]
            return final

        finals = await asyncio.gather(*(one(i) for i in range(10)))
        await engine.stop()
        return finals, engine.engine.num_steps - steps_before, engine.engine.stats()

    finals, num_steps, stats = asyncio.run(run())
    for got, want in zip(finals, expected):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert got.finished
    assert stats["mean_batch_size"] > 1.5  # the callers shared steps (continuous batching)
    assert num_steps < sum(len(c.token_ids) for o in finals for c in o.outputs) / 2


def test_leaving_early_aborts_and_frees_blocks(tiny_checkpoint):
    async def run():
        engine = AsyncLLMEngine(_engine(tiny_checkpoint))
        total = _free_blocks(engine)
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        async for output in engine.generate(PROMPTS[1], params, "leaves"):
            if len(output.outputs[0].token_ids) == 3:
                break  # the caller stops listening
        waiting = asyncio.create_task(anext(aiter(engine.generate(PROMPTS[2], params, "cancelled"))))
        await asyncio.sleep(0)
        waiting.cancel()  # cancelled while waiting for its first output
        await asyncio.gather(waiting, return_exceptions=True)
        with pytest.raises(ValueError, match="max_tokens"):
            engine.add_request("too-long", PROMPTS[0], SamplingParams(max_tokens=1000))
        *_, final = [o async for o in engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), "ok")]
        for _ in range(100):  # the aborts reach the engine at the loop's next turns
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        free = _free_blocks(engine)
        await engine.stop()
        return final, free, total, engine.engine.num_steps

    final, free, total, num_steps = asyncio.run(run())
    assert len(final.outputs[0].token_ids) == 4 and free == total
    assert num_steps < 60  # the aborted requests did not run their 100 tokens each


def test_full_queue_and_duplicate_ids_are_refused_at_once(tiny_checkpoint):
    async def run():
        engine = AsyncLLMEngine(_engine(tiny_checkpoint), max_waiting_requests=2)
        streams = [engine.add_request(f"r{i}", PROMPTS[0], SamplingParams(max_tokens=2)) for i in range(2)]
        with pytest.raises(QueueFullError, match="limit 2"):
            engine.add_request("r2", PROMPTS[0])
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("r0", PROMPTS[0])
        finals = [[o async for o in s][-1] for s in streams]
        await engine.stop()
        return finals

    assert all(f.finished for f in asyncio.run(run()))


def test_a_dead_engine_loop_fails_every_request_and_refuses_new_ones(tiny_checkpoint):
    async def run():
        engine = AsyncLLMEngine(_engine(tiny_checkpoint))

        def broken_device(inputs):
            raise RuntimeError("simulated device failure")

        engine.engine.runner.execute = broken_device
        with pytest.raises(EngineDeadError, match="the server log has the details") as died:
            async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=4), "a"):
                pass
        assert "simulated device failure" not in str(died.value)  # servers pass the message on to clients
        assert str(died.value.__cause__) == "simulated device failure"  # Python callers still see the cause
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.add_request("b", PROMPTS[0])
        await engine.stop()

    asyncio.run(run())


def test_a_burst_from_one_tenant_does_not_hold_up_another(tiny_checkpoint):
    """Issue 40: requests entered the engine first come, first served, so one client's burst (here 12 requests
    of 40 tokens, on an engine of 4 sequences) made another's 5-token request wait for all of it. By tenant
    turns, the other's request goes in as soon as a sequence finishes, and the burst waits for its share; one
    tenant's waiting requests are capped on their own (QueueFullError for that tenant alone)."""
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def run():
        engine = AsyncLLMEngine(_engine(tiny_checkpoint), max_waiting_per_tenant=12)
        finished = []

        async def one(tenant: str, i: int, params: SamplingParams):
            stream = engine.add_request(f"{tenant}-{i}", PROMPTS[i % 5], params, tenant=tenant)
            async for output in stream:
                pass
            finished.append(output.request_id)

        burst = [asyncio.create_task(one("burst", i, long)) for i in range(12)]
        await asyncio.sleep(0)  # all 12 are queued
        with pytest.raises(QueueFullError, match="of this API key"):
            engine.add_request("burst-12", PROMPTS[0], long, tenant="burst")
        engine.add_request("another-0", PROMPTS[0], short, tenant="another")  # other tenants are let in
        while engine.engine.num_steps < 3:  # the burst is running
            await asyncio.sleep(0.01)
        await one("other", 0, short)
        await asyncio.gather(*burst)
        await engine.stop()
        return finished

    finished = asyncio.run(run())
    print("finishing order:", finished)
    # First come, first served: after all 12 of the burst. By turns: after the 4 it found running.
    assert finished.index("other-0") <= 5
