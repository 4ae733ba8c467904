"""Swap against recompute by block size at GPU scale (the paper's Figure 19), from the serving simulator.

OPT-13B on one A100-40GB. (a) What preempting one request of 512 tokens costs: copying its blocks out (and
as long again back in) over PCIe, one copy per block, layer, K and V (simulator/cost_model.py's swap_time),
against computing its tokens again in a prefill, on the roofline. (b) vLLM end to end in both modes, ShareGPT-like
requests at 2.5 req/s, where the cache runs out and requests are preempted, on the paper's server with its
overheads (simulator/cost_model.py's paper_cost_model, as in simulated_serving.py). Simulated, not measured: the same figure on any machine.
"""

from docs.figures._figure import COLORS, plt, save
from simulator.cost_model import CostModel, paper_cost_model
from simulator.hardware import GiB, hardware
from simulator.model_spec import model_spec
from simulator.simulate import simulate
from simulator.systems import make_system
from simulator.workload import synthetic

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
TOKENS = 512
RATE, NUM_REQUESTS = 2.5, 300
COLOR = {"recompute": COLORS["accent"], "swap": COLORS["reserved"]}


def micro_benchmark(cost: CostModel) -> dict[str, list[float]]:
    """Milliseconds to swap one request's TOKENS out (or in), or to recompute them, by block size."""
    swap = [cost.swap_time(-(-TOKENS // size), size) * 1e3 for size in BLOCK_SIZES]
    recompute = cost.step_time([(0, TOKENS)], paged=True) * 1e3
    return {"swap": swap, "recompute": [recompute] * len(BLOCK_SIZES)}


def end_to_end(cost: CostModel) -> dict[str, list[float]]:
    """vLLM's normalized latency (s/token) in each preemption mode, by block size."""
    workload = synthetic("sharegpt", RATE, NUM_REQUESTS, seed=0)
    return {mode: [simulate("vllm", make_system("vllm", cost, block_size=size, swap_space_bytes=4 * GiB,
                                                preemption_mode=mode), workload, RATE).normalized_latency
                   for size in BLOCK_SIZES] for mode in ("recompute", "swap")}


if __name__ == "__main__":
    a100, opt_13b = hardware("a100-40gb"), model_spec("opt-13b")
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 3.3))
    micro = micro_benchmark(CostModel(a100, opt_13b))
    left.plot(BLOCK_SIZES, micro["swap"], marker="o", color=COLOR["swap"], label="swap out (or in)")
    left.plot(BLOCK_SIZES, micro["recompute"], marker="o", color=COLOR["recompute"], label="recompute")
    left.set_yscale("log")
    left.set_yticks([10, 20, 50, 100, 200], ["10", "20", "50", "100", "200"])
    left.set_ylabel("ms for one 512-token request")
    left.set_title("(a) micro-benchmark", loc="left", fontsize=10)
    for mode, latency in end_to_end(paper_cost_model("opt-13b")).items():
        right.plot(BLOCK_SIZES, latency, marker="o", color=COLOR[mode], label=mode)
    right.set_ylabel("normalized latency (s/token)")
    right.set_ylim(bottom=0)
    right.set_title(f"(b) end to end, ShareGPT at {RATE:g} req/s", loc="left", fontsize=10)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(BLOCK_SIZES, [str(s) for s in BLOCK_SIZES])
        ax.set_xlabel("block size (tokens)")
        ax.minorticks_off()
        ax.legend(frameon=False, fontsize=9)
    fig.suptitle("simulated: OPT-13B on an A100-40GB, 4 GiB of swap space", fontsize=10)
    fig.tight_layout()
    save(fig, "simulated_preemption")
