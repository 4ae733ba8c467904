"""Runs tests/multi_device/ in a process of its own with 4 CPU devices (XLA can split the host CPU into
several devices only before JAX starts, and the rest of the suite must keep one)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FORCED_DEVICES = "--xla_force_host_platform_device_count=4"


@pytest.mark.parametrize("module", sorted(p.name for p in (ROOT / "tests" / "multi_device").glob("test_*.py")))
def test_multi_device_module(module):
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FORCED_DEVICES}".strip()}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/multi_device/{module}"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    print(run.stdout[-20000:], run.stderr[-5000:])
    assert run.returncode == 0, run.stdout[-8000:]
