"""Lookahead slots and the roll-back: one request's blocks in the step that verifies its drafts, and after.

Drawn from step 2 of docs/examples/speculative_decoding.py (the reference engine, 4-token blocks, n-gram
drafts): the block table the scheduler reserved for the token and its four drafts, and the table, the prefix
cache and the free queue after two drafts were accepted, the third rejected and the blocks trimmed.
"""

from matplotlib.patches import Rectangle

from docs.figures._blocks import EDGE, TEXT_ON_DARK, canvas, legend, run_example
from docs.figures._figure import COLORS, save

step = run_example("speculative_decoding")["steps"][1]
BS = 4  # the example's block_size
GAP = 0.6  # between blocks
KINDS = {"computed": (COLORS["used"], "computed before the step"),
         "token": (COLORS["accent"], "the step's token"),
         "draft": (COLORS["reserved"], "draft (lookahead slot)"),
         "accepted": (COLORS["shared"], "accepted draft"),
         "next": ("white", "emitted, computed next step"),
         "freed": (COLORS["free"], "freed")}


def slot_x(position: int) -> float:
    return position + (position // BS) * GAP


def draw_row(ax, y: float, cells: list[tuple[str, str]], table: list[int], title: str,
             title_y: float = 1.3) -> None:
    """One slot per position, coloured by kind, grouped into the blocks of `table`."""
    ax.text(-0.2, y + title_y, title, fontsize=10, weight="bold", va="center")
    for position, (kind, text) in enumerate(cells):
        color = KINDS[kind][0]
        ax.add_patch(Rectangle((slot_x(position), y), 1, 0.9, facecolor=color, edgecolor=EDGE,
                               linewidth=0.5))
        dark = kind in ("computed", "token", "accepted")
        ax.text(slot_x(position) + 0.5, y + 0.45, text, ha="center", va="center", fontsize=9,
                color=TEXT_ON_DARK if dark else "black")
    for j, block_id in enumerate(table):
        ax.add_patch(Rectangle((slot_x(j * BS), y), BS, 0.9, fill=False, edgecolor=EDGE, linewidth=1.3))


tokens, drafts = step["tokens"], step["drafts"]
computed, computed_after = step["computed"], step["computed_after"]
before = [("computed" if p < computed else "token", str(t)) for p, t in enumerate(tokens)]
before += [("draft", str(t)) for t in drafts]
after_tokens = tokens + step["emitted"]
after = [("computed" if p < computed else "token" if p == computed else
          "accepted" if p < computed_after else "next", str(t)) for p, t in enumerate(after_tokens)]
num_slots = len(step["table"]) * BS
width = slot_x(num_slots - 1) + 1
fig, ax = canvas(7.2, 3.6, (-0.4, width + 0.3), (-2.3, 5.8))

# Before: the table as scheduled, every slot the step writes, with each slot's position.
y_before = 3.3
draw_row(ax, y_before, before, step["table"],
         f"in the step: its token and {len(drafts)} drafts are computed, positions "
         f"{computed}-{computed + step['new'] - 1}", title_y=1.85)
for position in range(num_slots):
    ax.text(slot_x(position) + 0.5, y_before + 0.95, str(position), ha="center", va="bottom",
            fontsize=9, color=COLORS["external"])
for j, block_id in enumerate(step["table"]):
    ax.text(slot_x(j * BS) + BS / 2, y_before - 0.3, f"block {block_id}", ha="center", va="center",
            fontsize=9)

# After: the verified tokens, the emitted token's slot, and the trimmed block.
y_after = 0.7
accepted = len(step["emitted"]) - 1
rejected = drafts[accepted]
trimmed = step["table"][len(step["after"]):]
cells = after + [("freed", "") for _ in range(num_slots - len(after))]
draw_row(ax, y_after, cells, step["table"],
         f"after: {accepted} drafts accepted, the next ({rejected}) rejected, "
         f"{step['emitted'][-1]} emitted at position {computed_after}")
for j, block_id in enumerate(step["table"]):
    if block_id in trimmed:
        note = "freed, never cached"
    elif block_id in step["cached"]:
        note = f"cached: {step['hashes'][block_id].hex()[:6]}"
    else:
        note = "not cached yet"
    ax.text(slot_x(j * BS) + BS / 2, y_after - 0.3, f"block {block_id}", ha="center", va="center",
            fontsize=9)
    ax.text(slot_x(j * BS) + BS / 2, y_after - 0.75, note, ha="center", va="center", fontsize=9)
ax.text(-0.2, y_after - 1.35, f"{computed_after} tokens computed; free queue, evicted first to last: "
        f"{step['free']}", fontsize=9, va="center")
legend(ax, [KINDS[k] for k in KINDS], ncol=3, bbox_to_anchor=(width / 2, y_after - 1.7),
       bbox_transform=ax.transData)
save(fig, "speculative_rollback")
