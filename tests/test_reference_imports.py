"""The oracle stays NumPy-only: every import in reference/ is numpy, the standard library, or itself."""

import ast
import pathlib
import sys

REFERENCE = pathlib.Path(__file__).parents[1] / "reference"
ALLOWED = {"numpy", "reference"} | set(sys.stdlib_module_names)


def _imported_modules(path: pathlib.Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add((node.module or "").split(".")[0])
    return modules


def test_reference_imports_only_numpy_and_stdlib():
    files = sorted(REFERENCE.glob("**/*.py"))
    assert len(files) >= 9
    offenders = {f.name: sorted(_imported_modules(f) - ALLOWED) for f in files}
    assert {name: bad for name, bad in offenders.items() if bad} == {}


def test_importing_reference_does_not_load_jax():
    import subprocess

    code = "import sys, reference; print('jax' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
