"""Tests that need several JAX devices. They run in their own process (tests/test_multi_device.py starts it
with XLA_FLAGS=--xla_force_host_platform_device_count=4), so that the rest of the suite keeps one device."""

import jax
import pytest

DEVICES = 4


def pytest_configure(config):
    if jax.device_count() < DEVICES:
        raise pytest.UsageError(f"tests/multi_device needs {DEVICES} devices, this process has {jax.device_count()}: "
                                "run it through tests/test_multi_device.py (or set XLA_FLAGS="
                                f"--xla_force_host_platform_device_count={DEVICES})")
