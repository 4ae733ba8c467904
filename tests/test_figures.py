"""Every figure on the site is made by code: each committed SVG equals what its script makes now."""

import pathlib
import subprocess
import sys

import pytest

from docs.figures._figure import FIGURES, scripts

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.parametrize("script", scripts(), ids=lambda p: p.stem)
def test_committed_figure_is_what_its_script_makes(script, tmp_path):
    result = subprocess.run([sys.executable, "-m", f"docs.figures.{script.stem}", "--out", str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    made = sorted(tmp_path.glob("*.svg"))
    assert made, f"{script.name} wrote no SVG"
    for svg in made:
        committed = FIGURES / svg.name
        assert committed.exists(), f"{svg.name} is not committed: run `make figures`"
        assert committed.read_bytes() == svg.read_bytes(), f"{svg.name} is stale: run `make figures`"


def test_every_committed_figure_has_a_script_and_a_page():
    pages = "".join(p.read_text() for p in (ROOT / "docs").glob("**/*.md"))
    for svg in FIGURES.glob("*.svg"):
        assert any(svg.stem.startswith(s.stem) for s in scripts()), f"{svg.name} has no script"
        assert f"figures/{svg.name}" in pages, f"no page shows {svg.name}"
