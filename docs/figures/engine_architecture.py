"""The reference engine's architecture (the paper's Figure 4), drawn from a real ReferenceEngine.

The engine of docs/examples/engine_loop_step.py (the same tiny Llama, requests and budget), given a host
pool of 4 blocks so that both allocators show, after its first step; the SchedulerOutput is its second
step's. Every name is read off the objects (class names, queues, block tables, array shapes), and each
arrow's method must exist on the object it calls.
"""

from matplotlib.patches import FancyBboxPatch

from docs.figures._blocks import run_example
from docs.figures._figure import COLORS, plt, save
from reference import ReferenceEngine, SamplingParams, sample
from reference.scheduler import SchedulerConfig

example = run_example("engine_loop_step")
engine = ReferenceEngine(example["tiny_llama"](), num_blocks=8, block_size=4, num_host_blocks=4,
                         scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8,
                                                          max_model_len=32, enable_chunked_prefill=True))
greedy = SamplingParams(temperature=0, max_tokens=4)
engine.add_request("a", [5, 9, 2, 7, 1, 3], greedy)
engine.add_request("b", [4, 4, 8, 6, 2], greedy)
engine.step()
scheduler, bm, cache, model = engine.scheduler, engine.scheduler.block_manager, engine.kv_cache, engine.model
out = scheduler.schedule()  # the second step's decisions
for obj, method in ((engine, "step"), (scheduler, "schedule"), (scheduler, "update_from_output"),
                    (cache, "copy_blocks"), (cache, "swap_in"), (cache, "swap_out"), (engine, "_prepare_batch"),
                    (model, "forward")):
    assert callable(getattr(obj, method)), f"{type(obj).__name__} has no {method}"


def name(obj) -> str:
    return type(obj).__name__


def box(ax, x, y, w, h, title, lines=(), color=COLORS["used"], colors=None):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=1.2", linewidth=1.4,
                                edgecolor=color, facecolor="white"))
    ax.text(x + 1.5, y + h - 1.5, title, ha="left", va="top", fontweight="bold", color=color)
    for i, line in enumerate(lines):
        ax.text(x + 1.5, y + h - 6 - 4 * i, line, ha="left", va="top", color=(colors or {}).get(i, "black"))


def arrow(ax, start, end, label, where, style="-|>"):
    ax.annotate("", end, start, arrowprops=dict(arrowstyle=style, color=COLORS["accent"], lw=1.6,
                                                 shrinkA=0, shrinkB=0))
    ax.text(*where, label, ha="center", va="center", color=COLORS["accent"], fontweight="bold",
            bbox=dict(facecolor="white", edgecolor="none", pad=1))


def queue(requests) -> str:
    return str([r.request_id for r in requests])


fig, ax = plt.subplots(figsize=(7.2, 5.8))
ax.set_xlim(0, 100)
ax.set_ylim(-1, 82)
ax.axis("off")
ax.text(0, 82, f"{name(engine)}.step(): 1 schedule()  2 swap_out, swap_in, copy_blocks", va="top",
        fontweight="bold")
ax.text(0, 77.5, f"3 _prepare_batch  4 forward  5 {sample.__name__}  6 update_from_output", va="top",
        fontweight="bold")
# The scheduler, with the block manager it owns (the paper's KV cache manager and its two allocators).
box(ax, 0, 34, 52, 38, name(scheduler), [f"waiting {queue(scheduler.waiting)}",
                                        f"running {queue(scheduler.running)}",
                                        f"swapped {queue(scheduler.swapped)}"])
tables = "  ".join(f"{seq} {[b.block_id for b in blocks]}" for seq, blocks in bm.block_tables.items())
pools = [f"{where} {name(pool)}: {len(pool.blocks)} blocks, {len(pool.free_queue)} free"
         for where, pool in (("device", bm.device), ("host", bm.host))]
box(ax, 2, 35.5, 48, 18, f"{name(bm)} (block_size {bm.block_size})", ["block tables: " + tables, *pools],
    color=COLORS["shared"], colors={1: COLORS["reserved"], 2: COLORS["reserved"]})
# The step's decisions.
scheduled = [f"{s.request_id}: {s.num_new_tokens} new, blocks {s.block_table}" for s in out.scheduled]
box(ax, 58, 42, 42, 30, name(out), scheduled + [f"swap_out {out.swap_out}", f"swap_in {out.swap_in}",
                                                f"copies {out.copies}"])
# The model, and the cache whose keys and values it writes and reads.
cfg = model.config
box(ax, 0, 0, 46, 22, name(model), [f"{cfg.num_layers} layers, {cfg.num_heads} heads, "
                                    f"{cfg.num_kv_heads} KV heads", "forward(): write_kv at the slots,",
                                    "paged_attention via the tables"])
box(ax, 54, 0, 46, 22, name(cache), [f"k, v {cache.k.shape}", f"host_k, host_v {cache.host_k.shape}",
                                     "[layers, blocks, block_size,", " KV heads, head_dim]"])
arrow(ax, (52, 60), (58, 60), "1", (55, 63))
arrow(ax, (80, 42), (80, 22), "2", (80, 32))
arrow(ax, (62, 42), (40, 22), "3 4", (51, 32))
arrow(ax, (16, 22), (16, 34), "5 6", (16, 28))
arrow(ax, (46, 11), (54, 11), "K/V", (50, 14.5), style="<|-|>")
save(fig, "engine_architecture")
