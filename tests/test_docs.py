"""The tutorial is tested: its example files run and their printed output matches the page (tests/test_site.py
builds the site and reads it in a browser)."""

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parents[1]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
# A page includes an example with a snippet line, optionally followed by its output in a text block; both may be
# indented alike (an exercise's answer inside a "??? success" block).
INCLUDE = re.compile(r'^( *)--8<-- "(docs/examples/[\w.]+)"\n\1```\n(?:\n\1Its output:\n\n\1```text\n(.*?)^\1```)?',
                     re.S | re.M)


def _dedent(text: str | None, indent: str) -> str | None:
    return None if text is None else "".join(line.removeprefix(indent) for line in text.splitlines(keepends=True))


# Examples and their outputs are read on the site without scrolling sideways (tests/test_site.py checks
# the rendered blocks too).
MAX_COLUMNS = 88


def run_example(path: pathlib.Path) -> str:
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


def includes(example: pathlib.Path) -> list[tuple[pathlib.Path, str | None]]:
    """(page, the output shown after it, or None) for every page that includes the example."""
    return [(page, _dedent(m.group(3), m.group(1))) for page in sorted((ROOT / "docs").glob("**/*.md"))
            for m in INCLUDE.finditer(page.read_text()) if m.group(2) == f"docs/examples/{example.name}"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_and_pages_show_its_real_output(example):
    stdout = run_example(example)
    shown = includes(example)
    assert shown, f"no page includes {example.name}"
    for page, output in shown:
        if output is not None:
            assert output == stdout, f"{page.relative_to(ROOT)} shows another output than {example.name} prints"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_and_its_shown_output_fit_88_columns(example):
    texts = [(example.relative_to(ROOT), example.read_text())]
    texts += [(f"{page.relative_to(ROOT)} (output of {example.name})", output)
              for page, output in includes(example) if output is not None]
    too_long = [f"{where}, line {number}: {len(line)} columns" for where, text in texts
                for number, line in enumerate(text.splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not too_long, f"longer than {MAX_COLUMNS} columns:\n" + "\n".join(too_long)


SECTION = re.compile(r'--8<-- "((?:reference|jax_engine|pallas_kernels)/[\w/.]+):(\w+)"')


def included_section(path: str, name: str) -> str:
    """The lines between a source file's `--8<-- [start:name]` and `[end:name]` markers, dedented as the site
    shows them (mkdocs.yml: dedent_subsections)."""
    text = (ROOT / path).read_text()
    body = text.split(f"# --8<-- [start:{name}]\n", 1)[1].split(f"# --8<-- [end:{name}]", 1)[0]
    return textwrap.dedent(body)


def test_code_included_from_the_source_fits_88_columns():
    """The oracle's code on the pages (snippet sections of reference/) fits the column as the examples do."""
    too_long = [f"{page.relative_to(ROOT)}: {path}:{name}, line {number}: {len(line)} columns"
                for page in sorted((ROOT / "docs").glob("**/*.md"))
                for path, name in SECTION.findall(page.read_text())
                for number, line in enumerate(included_section(path, name).splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not too_long, f"longer than {MAX_COLUMNS} columns:\n" + "\n".join(too_long)


@pytest.mark.parametrize("index", [0, 1])
def test_readme_python_examples_run(index):
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[index]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
