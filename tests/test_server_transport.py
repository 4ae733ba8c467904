"""What a client can hold of the server's connections, buffers and shutdown: clients without a key, slow bodies,
streams nobody reads, SIGTERM beside them. Checked against `jax-engine serve` in its own process on 127.0.0.1
(tiny random models), so the server's memory and exit status are its own."""

import asyncio

from jax_engine.server.streams import merge


class _FakeStream:
    """A RequestStream that produces `count` outputs as fast as the loop lets it."""

    def __init__(self, count: int) -> None:
        self.count = count

    async def __aiter__(self):
        for i in range(self.count):
            await asyncio.sleep(0)
            yield i


def test_a_reader_that_falls_behind_holds_one_output_per_stream():
    """Outputs are cumulative: a reader that comes back after a while gets each stream's newest, not a backlog."""

    async def read_late() -> list[tuple[int, int]]:
        merged = merge([_FakeStream(1000), _FakeStream(1000)])
        first = await anext(merged)
        await asyncio.sleep(0.5)  # both streams finish while the reader is away
        return [first] + [item async for item in merged]

    items = asyncio.run(read_late())
    print(items)
    assert sorted(items[1:]) == [(0, 999), (1, 999)]
