"""A serving simulator: the paper's experiments at GPU scale, from the oracle's own scheduler (issue 45).

A discrete-event loop replays a workload (arrival times, prompt and output lengths) through a serving system, and
a roofline cost model stands in for the GPU: each step takes as long as reading the weights and the KV cache it
attends over, or computing its FLOPs, whichever is longer, plus fixed overheads. NumPy and the standard library
only, like the oracle it drives.

    hardware.py     public spec sheets: memory, bandwidth, peak FLOPs, PCIe
    model_spec.py   a model's shapes, from config.json or a preset: weight bytes, KV bytes per token
    capacity.py     the KV cache beside the weights (the engine sizes its own cache with it)
    cost_model.py   step time and swap time on a hardware for a model; the paper's overheads
    cpu_fit.py      a cost model of this CPU, read off recorded runs of the engine
    workload.py     Poisson arrivals, ShareGPT- and Alpaca-like lengths, or a JSONL trace
    buddy.py        a contiguous KV cache placed by a buddy allocator, as the paper's Orca baselines
    systems.py      vLLM (the oracle's Scheduler and BlockManager) and the paper's baselines
    simulate.py     the loop, and what it reports per (system, rate)
    cli.py, plan.py `jax-engine simulate` and `jax-engine plan` (options.py: what they share)

docs/simulator.md shows it against the paper and against this engine.
"""
