"""What every figure script shares: one style, and SVG output that is byte-for-byte reproducible.

A figure script is `docs/figures/<name>.py`; run as a module it writes `docs/figures/<name>.svg` (or, with
`--out DIR`, into DIR). It draws from real objects of `reference/` (or from measurements recorded in
`docs/figures/data/`, with the command that made them), never from numbers typed in by hand.
`make figures` runs them all; tests/test_figures.py fails when a committed SVG differs from what its
script makes now.

Legible at the column's width: a figure is shown at its own size (1 pt of the SVG is 4/3 CSS px) in the
tutorial's column, 748 px wide in a 1280-pixel window. So `save` raises every text under MIN_FONT_PT to it
(9 pt: 12 px on the screen, what tests/test_site.py requires), and refuses a figure wider than the column,
which the browser would shrink, and its text with it.
"""

import argparse
import pathlib
import re

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

FIGURES = pathlib.Path(__file__).parent
DATA = FIGURES / "data"
# Colours used across the tutorial, so that "used", "reserved"... mean the same colour on every page.
COLORS = {"used": "#4c72b0", "reserved": "#dd8452", "internal": "#c44e52", "external": "#8c8c8c",
          "free": "#e5e5e5", "shared": "#55a868", "accent": "#8172b3"}
# The smallest text of any figure, in points (1 pt = 4/3 CSS px: 9 pt is 12 px at the figure's own size).
MIN_FONT_PT = 9
# The widest figure, in points: the column's 748 px at 1280 px (docs/stylesheets/extra.css).
MAX_WIDTH_PT = 748 * 3 / 4

plt.rcParams.update({
    "svg.hashsalt": "paged-llm",  # element ids come from this salt, not from a random one
    "svg.fonttype": "none",  # text stays text: smaller files, no font glyphs embedded
    "font.family": "DejaVu Sans",
    "font.size": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.dpi": 100,
})


def save(fig: "matplotlib.figure.Figure", name: str, argv: list[str] | None = None) -> pathlib.Path:
    """Write the figure as `<name>.svg` into docs/figures (or --out DIR) with fixed metadata; returns the path."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=FIGURES)
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.svg"
    fig.canvas.draw()  # makes every tick label, so that the loop below sees them all
    for text in fig.findobj(matplotlib.text.Text):
        if text.get_visible() and text.get_text() and text.get_fontsize() < MIN_FONT_PT:
            text.set_fontsize(MIN_FONT_PT)
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    width = float(re.search(r'<svg[^>]* width="([\d.]+)pt"', path.read_text()).group(1))
    if width > MAX_WIDTH_PT:
        path.unlink()
        raise ValueError(f"{name}.svg is {width:.0f} pt wide, more than the column's {MAX_WIDTH_PT:.0f} pt: "
                         "a browser would shrink it and its text below 9 pt; make the figure narrower")
    return path


def scripts() -> list[pathlib.Path]:
    """Every figure script, in name order."""
    return sorted(p for p in FIGURES.glob("*.py") if not p.name.startswith("_"))
