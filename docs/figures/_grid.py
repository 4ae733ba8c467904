"""A step-by-request grid (rows = requests, columns = steps), shared by the scheduling figures."""

from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle


def draw_grid(ax: Axes, rows: list[str], cells: dict[tuple[int, int], tuple[str, str]], num_steps: int,
              title: str) -> None:
    """Colour cell (row, step) with `cells[(row, step)] = (color, label)`; empty cells stay white."""
    for (row, step), (color, label) in cells.items():
        ax.add_patch(Rectangle((step, row), 1, 1, facecolor=color, edgecolor="white", linewidth=1.5))
        if label:
            ax.text(step + 0.5, row + 0.5, label, ha="center", va="center", fontsize=9, color="white")
    ax.set_xlim(0, num_steps)
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([i + 0.5 for i in range(len(rows))], rows)
    ax.set_xticks([i + 0.5 for i in range(num_steps)], [str(i) for i in range(num_steps)], fontsize=9)
    ax.tick_params(length=0)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, loc="left", fontsize=10)


def legend_handles(entries: dict[str, str]) -> list[Patch]:
    return [Patch(facecolor=color, label=label) for label, color in entries.items()]
