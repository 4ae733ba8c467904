"""What every figure script shares: one style, and SVG output that is byte-for-byte reproducible.

A figure script is `docs/figures/<name>.py`; run as a module it writes `docs/figures/<name>.svg` (or, with
`--out DIR`, into DIR). It draws from real objects of `reference/` (or from measurements recorded in
`docs/figures/data/`, with the command that made them), never from numbers typed in by hand.
`make figures` runs them all; tests/test_figures.py fails when a committed SVG differs from what its
script makes now.
"""

import argparse
import pathlib

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

FIGURES = pathlib.Path(__file__).parent
DATA = FIGURES / "data"
# Colours used across the tutorial, so that "used", "reserved"... mean the same colour on every page.
COLORS = {"used": "#4c72b0", "reserved": "#dd8452", "internal": "#c44e52", "external": "#8c8c8c",
          "free": "#e5e5e5", "shared": "#55a868", "accent": "#8172b3"}

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
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return path


def scripts() -> list[pathlib.Path]:
    """Every figure script, in name order."""
    return sorted(p for p in FIGURES.glob("*.py") if not p.name.startswith("_"))
