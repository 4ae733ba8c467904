"""Which devices each data-parallel replica runs on (vLLM's data_parallel_size), wherever the replica is built: in
the server's process (jax_engine/server/data_parallel.py) or in an engine core process of its own (engine_core/)."""

import jax

from jax_engine.config import EngineArgs


def replica_devices(args: EngineArgs) -> list[list]:
    """Each replica's devices, in jax.devices() order: replica r on [r * tp, (r + 1) * tp); ValueError when there
    are too few."""
    if args.nnodes > 1:
        raise ValueError(f"data_parallel_size > 1 runs on one host, got nnodes={args.nnodes}")
    devices, tp, dp = jax.devices(), args.tensor_parallel_size, args.data_parallel_size
    if dp * tp > len(devices):
        raise ValueError(f"data_parallel_size * tensor_parallel_size must be <= the number of devices "
                         f"({len(devices)}: {devices[0].platform}), got {dp} * {tp} = {dp * tp}")
    return [devices[r * tp : (r + 1) * tp] for r in range(dp)]
