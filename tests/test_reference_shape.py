"""The oracle stays readable in an hour (issue 41): a core of about 1,000 lines in short files and short functions.

What only the tutorial needs lives in reference/tutorial/, and input hardening in jax_engine/input_checks.py,
so neither counts here.
"""

import ast
import pathlib

REFERENCE = pathlib.Path(__file__).parents[1] / "reference"
CORE = ["block_pool", "block_manager", "request", "scheduler", "paged_attention", "kv_cache", "llama", "sampler",
        "engine", "beam_search"]
MAX_CORE_LINES = 1300
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 50


def _lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def test_the_core_is_the_top_level_and_stays_under_its_line_budget():
    assert sorted(p.stem for p in REFERENCE.glob("[!_]*.py")) == sorted(CORE)
    counts = {name: _lines(REFERENCE / f"{name}.py") for name in CORE}
    print(counts, sum(counts.values()))
    assert sum(counts.values()) < MAX_CORE_LINES, counts


def test_no_file_or_function_is_long():
    long_files, long_functions = [], []
    for path in sorted(REFERENCE.rglob("*.py")):
        if _lines(path) > MAX_FILE_LINES:
            long_files.append(f"{path.name}: {_lines(path)} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    assert long_files == [] and long_functions == []
