"""Runs tests/multi_device/ in processes of their own with 4 CPU devices (XLA can split the host CPU into
several devices only before JAX starts, and the rest of the suite must keep one)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FORCED_DEVICES = "--xla_force_host_platform_device_count=4"
# Modules that must start in a fresh process (their docstrings say why) run alone; the rest share one process,
# which starts JAX and loads the default model once.
ALONE = ("test_data_parallel_startup.py",)
SHARED = tuple(sorted(p.name for p in (ROOT / "tests" / "multi_device").glob("test_*.py") if p.name not in ALONE))


@pytest.mark.parametrize("modules", [SHARED, *((m,) for m in ALONE)], ids=lambda modules: "+".join(modules))
def test_multi_device_modules(modules):
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FORCED_DEVICES}".strip()}
    paths = [f"tests/multi_device/{module}" for module in modules]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    print(run.stdout[-20000:], run.stderr[-5000:])
    assert run.returncode == 0, run.stdout[-8000:]
