"""Drawing KV blocks for the tutorial's diagrams, from the objects of a docs/examples/ script.

A diagram runs the example its page shows (`run_example`) and draws that run's real objects (block tables,
reference counts, the free queue), so the picture and the printed output cannot disagree.
"""

import contextlib
import io
import pathlib
import runpy

from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from docs.figures._figure import plt

ROOT = pathlib.Path(__file__).parents[2]
EDGE = "#333333"
TEXT_ON_DARK = "white"


def run_example(name: str) -> dict:
    """Run docs/examples/<name>.py with its output silenced; return its module globals."""
    with contextlib.redirect_stdout(io.StringIO()):
        return runpy.run_path(str(ROOT / "docs" / "examples" / f"{name}.py"), run_name="__main__")


def canvas(width: float, height: float, xlim: tuple[float, float], ylim: tuple[float, float]):
    """A figure with one axis in data units (1 unit = one slot's width), no frame.

    The axis fills the figure (no margins for ticks it does not have), so the drawing is as large as
    `width` x `height` allows and its text, at least 9 pt, fits in its boxes.
    """
    fig, ax = plt.subplots(figsize=(width, height))
    fig.subplots_adjust(left=0, right=1, bottom=0, top=1)
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def block(ax, x: float, y: float, cells: list[str], color: str, *, width: float = 1.0, height: float = 0.8,
          text_color: str = "black", fontsize: float = 9, empty_color: str = "white") -> None:
    """One block of len(cells) slots, each `width` wide, with its left edge at x and bottom at y.

    An empty string is an empty slot (drawn in `empty_color`).
    """
    for i, text in enumerate(cells):
        ax.add_patch(Rectangle((x + i * width, y), width, height, facecolor=color if text else empty_color,
                               edgecolor=EDGE, linewidth=0.5))
        if text:
            ax.text(x + (i + 0.5) * width, y + height / 2, text, ha="center", va="center", fontsize=fontsize,
                    color=text_color)
    ax.add_patch(Rectangle((x, y), len(cells) * width, height, fill=False, edgecolor=EDGE, linewidth=1.2))


def arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str = "#555555", **kwargs) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=8, color=color, linewidth=0.9,
                                 shrinkA=1, shrinkB=1, **kwargs))


def legend(ax, entries: list[tuple[str, str]], **kwargs) -> None:
    """Colour swatches with labels in one row under the drawing."""
    handles = [Patch(facecolor=color, edgecolor=EDGE, linewidth=0.5, label=label) for color, label in entries]
    options = dict(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), frameon=False, fontsize=9)
    ax.legend(handles=handles, **(options | kwargs))


def block_manager_diagram(bm, *, width: float = 7.0, seq_order: list[str] | None = None, row_height: float = 1.0):
    """Block tables (left) pointing at physical blocks (right), coloured by reference count.

    Each physical block is labelled with its ref_cnt, its place in the free queue, and the start of its hash
    if it is in the prefix cache. Returns (fig, ax); the caller adds a title or notes and saves.
    """
    from docs.figures._figure import COLORS

    pool = bm.device
    queue = list(pool.free_queue)
    n = pool.num_blocks
    seq_x, cell, phys_x, phys_w = 0.0, 1.4, 10.0, 6.5
    row_y = lambda row: (n - 1 - row) * row_height  # noqa: E731  (physical block 0 at the top)
    fig, ax = canvas(width, 0.42 * n * row_height + 1.2, (-2.2, phys_x + phys_w + 0.3),
                     (-1.2, n * row_height + 0.8))
    ax.text(seq_x + 2.5, n * row_height + 0.2, "block tables", ha="center", fontsize=9, weight="bold")
    ax.text(phys_x + phys_w / 2, n * row_height + 0.2, "physical blocks", ha="center", fontsize=9, weight="bold")
    for b in pool.blocks:
        y = row_y(b.block_id)
        if b.ref_cnt > 1:
            colour, text = COLORS["shared"], f"block {b.block_id}: ref_cnt {b.ref_cnt}"
        elif b.ref_cnt == 1:
            colour, text = COLORS["used"], f"block {b.block_id}: ref_cnt 1"
        else:
            colour, text = COLORS["free"], f"block {b.block_id}: free, queue position {queue.index(b.block_id) + 1}"
        if b.block_hash is not None:
            text += f", hash {b.block_hash.hex()[:6]}"
        ax.add_patch(Rectangle((phys_x, y), phys_w, 0.8, facecolor=colour, edgecolor=EDGE, linewidth=1.0))
        ax.text(phys_x + 0.2, y + 0.4, text, va="center", fontsize=9,
                color="black" if b.ref_cnt == 0 else TEXT_ON_DARK)

    seqs = seq_order or list(bm.block_tables)
    spacing = (n - 1) / max(len(seqs) - 1, 1)
    for i, seq in enumerate(seqs):
        y = row_y(round(i * spacing))
        ax.text(seq_x - 0.3, y + 0.4, seq, ha="right", va="center", fontsize=9)
        for j, block_id in enumerate(bm.block_table(seq)):
            x = seq_x + j * cell
            shared = pool.blocks[block_id].ref_cnt > 1
            colour = COLORS["shared"] if shared else COLORS["used"]
            ax.add_patch(Rectangle((x, y), cell, 0.8, facecolor=colour, edgecolor=EDGE, linewidth=1.0, zorder=2))
            ax.text(x + cell / 2, y + 0.4, str(block_id), ha="center", va="center", fontsize=9, color=TEXT_ON_DARK,
                    zorder=3)
            # Drawn under the cells, so each arrow seems to leave its cell's edge.
            arrow(ax, (x + cell / 2, y + 0.4), (phys_x - 0.05, row_y(block_id) + 0.4), color=colour, alpha=0.7,
                  zorder=1)
    ax.text(seq_x - 2.0, -0.75, f"free queue, evicted first to last: {queue}", fontsize=9, va="center")
    legend(ax, [(COLORS["used"], "held by one sequence"), (COLORS["shared"], "shared (ref_cnt > 1)"),
                (COLORS["free"], "free")])
    return fig, ax
