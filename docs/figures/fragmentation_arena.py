"""The four kinds of slot in a contiguously allocated KV cache, at one step of `first_fit_steps`.

Five requests (prompt and output lengths below) each reserve their prompt plus the power of two at or above
their output length (the paper's Orca (Pow2)), served first come, first served from a 32-slot arena by a first-fit allocator
(reference/tutorial/kv_memory.py). The step drawn is the first in which the next request waits although enough
slots are free in total.
"""

from matplotlib.patches import Rectangle

from docs.figures._blocks import EDGE, canvas, legend
from docs.figures._figure import COLORS, save
from reference.tutorial.kv_memory import first_fit_steps

NAMES = "ABCDE"
trace = [(4, 3), (3, 5), (3, 5), (2, 3), (2, 2)]  # (prompt, output) tokens of requests A-E
reservations = [p + (1 << (o - 1).bit_length()) for p, o in trace]  # the paper's Pow2
arena = 32

admitted: set[int] = set()
for step, (chunks, num_waiting) in enumerate(first_fit_steps(trace, reservations, arena), 1):
    admitted |= {c.request for c in chunks}
    free = arena - sum(c.size for c in chunks)
    if num_waiting and free >= reservations[min(set(range(len(trace))) - admitted)]:
        break
waiting = min(set(range(len(trace))) - admitted)
kind = ["external"] * arena  # a free slot while a request waits
for c in chunks:
    for s in range(c.size):
        kind[c.start + s] = "used" if s < c.filled else "reserved" if s < c.final else "internal"
holes = [end - start for start, end in zip([0] + [c.start + c.size for c in chunks],
                                           [c.start for c in chunks] + [arena]) if end > start]

fig, ax = canvas(7.4, 2.3, (-0.5, arena + 0.5), (-2.6, 3.2))
for s, k in enumerate(kind):
    ax.add_patch(Rectangle((s, 0), 1, 1, facecolor=COLORS[k], edgecolor="white", linewidth=0.8))
for c in chunks:
    ax.add_patch(Rectangle((c.start, 0), c.size, 1, fill=False, edgecolor=EDGE, linewidth=1.4))
    ax.text(c.start + c.size / 2, 1.15, f"request {NAMES[c.request]}: {c.size} slots\n"
            f"{c.filled} stored, {c.final - c.filled} to come,\n{c.size - c.final} never used",
            ha="center", va="bottom", fontsize=9)
for s in range(0, arena + 1, 8):
    ax.text(s, -0.15, str(s), ha="center", va="top", fontsize=9, color="#555555")
ax.text(arena / 2, -0.75, f"after step {step}: request {NAMES[waiting]} waits for {reservations[waiting]} "
        f"contiguous slots; {free} are free, in holes of {' and '.join(map(str, holes))}",
        ha="center", va="top", fontsize=9)
legend(ax, [(COLORS["used"], "used"), (COLORS["reserved"], "reserved (future tokens)"),
            (COLORS["internal"], "internal fragmentation"), (COLORS["external"], "external fragmentation")],
       bbox_to_anchor=(0.5, 0.2), fontsize=9)
save(fig, "fragmentation_arena")
