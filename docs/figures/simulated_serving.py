"""Normalized latency against request rate at GPU scale (the paper's Figure 12a), from the serving simulator.

OPT-13B on one A100-40GB with the paper's 12 GB of KV cache, ShareGPT-like requests, every system of the paper
(simulator/systems.py), with the cost model fitted to the paper's vLLM (simulator/cost_model.py's
paper_cost_model). Simulated, not measured: the
same figure on any machine.
"""

from docs.figures._figure import COLORS, plt, save
from simulator.cost_model import paper_cost_model
from simulator.simulate import simulate
from simulator.systems import make_system
from simulator.workload import synthetic

RATES = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0]
NUM_REQUESTS = 200
SYSTEMS = {"vllm": ("vLLM", COLORS["used"]), "orca-oracle": ("Orca (Oracle)", COLORS["shared"]),
           "orca-pow2": ("Orca (Pow2)", COLORS["reserved"]), "orca-max": ("Orca (Max)", COLORS["internal"]),
           "ft": ("FasterTransformer", COLORS["external"])}

cost = paper_cost_model("opt-13b")
fig, ax = plt.subplots(figsize=(7, 3.5))
for name, (label, color) in SYSTEMS.items():
    latency = [simulate(name, make_system(name, cost), synthetic("sharegpt", rate, NUM_REQUESTS, seed=0), rate)
               .normalized_latency for rate in RATES]
    ax.plot(RATES, latency, marker="o", color=color, label=label)
ax.set_xlabel("request rate (requests/s, Poisson arrivals)")
ax.set_ylabel("normalized latency (s/token)")
ax.set_ylim(0, 1.0)  # the paper's scale; FasterTransformer and Orca (Max) leave it early
ax.set_title(f"simulated: OPT-13B on an A100-40GB, {NUM_REQUESTS} ShareGPT-like requests per rate", loc="left",
             fontsize=10)
ax.legend(frameon=False, fontsize=9)
fig.tight_layout()
save(fig, "simulated_serving")
