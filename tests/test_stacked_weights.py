"""Start-up's weight stacking (models/weights.py): every layer in its slot, in the host memory the CPU backend
takes without a copy, and the next layer read on a thread in order."""

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_engine.models.weights import mapped_empty, read_ahead, stacked_on_device


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8])
def test_layers_are_stacked_in_order(dtype):
    rng = np.random.default_rng(0)
    layers = [{"w": (rng.standard_normal((5, 7)) * 50).astype(dtype), "w_scale": rng.random(5, np.float32)}
              for _ in range(4)]
    stacked = stacked_on_device(iter(layers), count=4)
    for name in ("w", "w_scale"):
        np.testing.assert_array_equal(np.asarray(stacked[name]), np.stack([layer[name] for layer in layers]))


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="an accelerator copies host memory to its own")
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8])
def test_the_cpu_backend_takes_the_stacks_memory_without_a_copy(dtype):
    host = mapped_empty((3, 1000, 7), dtype)
    assert host.ctypes.data % 4096 == 0 and host.flags.writeable
    assert jax.device_put(host).unsafe_buffer_pointer() == host.ctypes.data


def test_one_layer_is_returned_without_the_stack_axis():
    top = stacked_on_device(iter([{"embed": np.arange(6, dtype=np.float32).reshape(2, 3)}]), count=1, stack=False)
    np.testing.assert_array_equal(np.asarray(top["embed"]), np.arange(6).reshape(2, 3))


def test_read_ahead_keeps_the_order_and_raises_the_readers_error():
    assert list(read_ahead(lambda prefix: prefix * 2, ["a", "b", "c"])) == ["aa", "bb", "cc"]
    assert list(read_ahead(str.upper, ["only"])) == ["ONLY"]

    def read(prefix):
        if prefix == "bad":
            raise ValueError("the checkpoint has no 'bad'")
        return prefix

    with pytest.raises(ValueError, match="no 'bad'"):
        list(read_ahead(read, ["good", "bad", "never"]))
