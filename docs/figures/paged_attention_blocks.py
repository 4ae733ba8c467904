"""A sequence's logical blocks, its block table, and the scattered physical blocks they map to.

Drawn from docs/examples/paged_attention.py: its BlockManager, its block table, its words.
"""

from docs.figures._blocks import TEXT_ON_DARK, arrow, block, canvas, legend, run_example
from docs.figures._figure import COLORS, save

example = run_example("paged_attention")
bm, table, words, bs = example["bm"], example["table"], example["words"], example["block_size"]
num_blocks = bm.device.num_blocks
owner = {b: seq for seq in bm.block_tables for b in bm.block_table(seq)}  # physical block -> sequence
W = 2.0  # slot width: room for a word
LOGICAL_X, TABLE_X, PHYSICAL_X = 0.0, 11.0, 20.5


def cells_of(logical: int) -> list[str]:
    cells = words[logical * bs:(logical + 1) * bs]
    return cells + [""] * (bs - len(cells))


fig, ax = canvas(7.5, 3.0, (-1.2, PHYSICAL_X + bs * W + 0.3), (-0.3, num_blocks + 1.1))
row_y = lambda row: num_blocks - 1 - row  # noqa: E731  (row 0 at the top)
middle = LOGICAL_X + bs * W / 2
ax.text(middle, num_blocks + 0.5, "logical blocks", ha="center", fontsize=9, weight="bold")
ax.text(TABLE_X + 1.5, num_blocks + 0.5, "block table", ha="center", fontsize=9, weight="bold")
ax.text(PHYSICAL_X + bs * W / 2, num_blocks + 0.5, "physical blocks", ha="center", fontsize=9, weight="bold")

first_row = (num_blocks - len(table)) // 2  # logical blocks and table rows centred vertically
ax.text(TABLE_X, row_y(first_row) + 1.0, "logical", ha="center", fontsize=9, color="#555555")
ax.text(TABLE_X + 3, row_y(first_row) + 1.0, "physical", ha="center", fontsize=9, color="#555555")
for j, physical in enumerate(table):
    y = row_y(first_row + j)
    block(ax, LOGICAL_X, y, cells_of(j), COLORS["used"], width=W, text_color=TEXT_ON_DARK)
    ax.text(LOGICAL_X - 0.3, y + 0.4, str(j), ha="right", va="center", fontsize=9)
    ax.text(TABLE_X, y + 0.4, str(j), ha="center", va="center", fontsize=9)
    ax.text(TABLE_X + 3, y + 0.4, str(physical), ha="center", va="center", fontsize=9, weight="bold")
    arrow(ax, (LOGICAL_X + bs * W + 0.1, y + 0.4), (TABLE_X - 0.6, y + 0.4))
    arrow(ax, (TABLE_X + 3.6, y + 0.4), (PHYSICAL_X - 2.4, row_y(physical) + 0.4), color=COLORS["used"])

for physical in range(num_blocks):
    y = row_y(physical)
    ax.text(PHYSICAL_X - 0.2, y + 0.4, f"block {physical}", ha="right", va="center", fontsize=9)
    if owner.get(physical) == "speech":
        block(ax, PHYSICAL_X, y, cells_of(table.index(physical)), COLORS["used"], width=W, text_color=TEXT_ON_DARK)
    else:
        block(ax, PHYSICAL_X, y, [owner.get(physical, "")] * bs, COLORS["external"], width=W,
              text_color=TEXT_ON_DARK)

legend(ax, [(COLORS["used"], "the sequence's tokens"), (COLORS["external"], "other requests' blocks"),
            ("white", "empty slot")])
save(fig, "paged_attention_blocks")
