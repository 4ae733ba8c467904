"""Compiled programs kept on disk under a key of our own, so that a later start loads them without tracing.

JAX's persistent compilation cache keys a program by its lowered HLO, so even a warm start traces and lowers
the whole model once per step shape (~0.7 s each when SmolLM2's layers were unrolled) for its key. This store
keys a program by what determines it without tracing: the engine's source code, the jax and jaxlib versions,
the device, which native kernels are available, and the program's name and argument shapes. A hit is a file
read and a `deserialize_and_load` (~0.2 s for a step program, ~0.03 s for a sampler's). Programs that start-up
does not list still compile on first use through jit and JAX's own cache.

The files are executables: like JAX's cache directory, the store must only hold what this user compiled.
"""

import functools
import hashlib
import io
import logging
import os
import pickle
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import flax
import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from jax_engine import native

logger = logging.getLogger(__name__)

SOURCE_ROOT = Path(__file__).parents[1]  # jax_engine/, every folder of it
SOURCE_SUFFIXES = (".py", ".cc", ".h")
STALE_AFTER_SECONDS = 7 * 24 * 3600  # programs of other source versions are deleted after a week unused


@functools.cache
def source_digest() -> str:
    """A hash of every source file of the engine: any edit makes every stored program stale."""
    digest = hashlib.sha256()
    for path in sorted(p for p in SOURCE_ROOT.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(SOURCE_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def environment_key() -> str:
    """What a program's code depends on besides its arguments: versions, device, kernels, flags."""
    from jax_engine.attention import cpu as attention_kernel
    from jax_engine.linear import lora_bgmv, matmul
    from jax_engine.sample import greedy_argmax, top_k_top_p

    device = jax.devices()[0]
    # Asking registers each kernel, which a stored program that calls it needs before it loads.
    kernels = tuple(module.kernel_unavailable_reason() is None
                    for module in (attention_kernel, matmul, greedy_argmax, top_k_top_p, lora_bgmv))
    parts = (source_digest(), jax.__version__, jaxlib.__version__, flax.__version__, device.platform, device.device_kind,
             jax.device_count(), jax.process_index(), jax.process_count(), platform.machine(), native.cpu_signature(), kernels, os.environ.get("XLA_FLAGS"),
             jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)
    return repr(parts)


def signature(args: tuple, kwargs: dict) -> str:
    """The pytree structure and every leaf's shape, dtype and placement: all a compiled program knows of its
    inputs (the same shapes split over a mesh are another program)."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return f"{tree}|{[(tuple(np.shape(x)), str(x.dtype if hasattr(x, 'dtype') else np.result_type(x)), _placement(x)) for x in leaves]}"


def _placement(x) -> str:
    sharding = getattr(x, "sharding", None)
    if sharding is None:  # a host array: placed where the program runs
        return ""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):  # a program loads onto its device only
        return f"@{[d.id for d in sharding.device_set]}"
    return f"{sharding.spec}@{[d.id for d in sharding.mesh.devices.flat]}"


class ExecutableStore:
    """Compiled programs under `root`, one folder per environment (every edit of the engine makes a new one),
    one file per program."""

    def __init__(self, root: Path) -> None:
        self.environment = environment_key()
        self.directory = root / hashlib.sha256(self.environment.encode()).hexdigest()[:16]
        _prune(root, keep=self.directory)


    def path(self, name: str, args: tuple, kwargs: dict, static: tuple) -> Path:
        static_names = [getattr(x, "__qualname__", repr(x)) for x in static]  # a function's repr has its address
        key = "\n".join((self.environment, name, repr(static_names), signature(args, kwargs)))
        return self.directory / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.bin"

    def load(self, path: Path) -> jax.stages.Compiled | None:
        """The stored program, or None when there is none (or it cannot be read: it is then compiled anew)."""
        if not path.exists():
            return None
        try:
            payload, in_tree, out_tree, device_ids = _DeviceUnpickler(io.BytesIO(path.read_bytes())).load()
            devices = {d.id: d for d in jax.devices()}
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=[devices[i] for i in device_ids])
        except Exception as error:  # a truncated or foreign file must not stop the engine
            logger.warning("could not load %s (%s: %s); compiling it again", path, type(error).__name__, error)
            return None

    def save(self, path: Path, compiled: jax.stages.Compiled) -> None:
        try:
            file = io.BytesIO()
            _DevicePickler(file).dump((*serialize_executable.serialize(compiled), _device_ids(compiled)))
            payload = file.getvalue()
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(payload)
            os.replace(partial, path)  # atomic: another process never reads half a file
        except Exception as error:  # a program that cannot be stored is compiled again next time, nothing worse
            logger.warning("could not store %s (%s: %s)", path, type(error).__name__, error)

    def compile(self, path: Path, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
        compiled = lower().compile()
        self.save(path, compiled)
        return compiled


def _device_ids(compiled: jax.stages.Compiled) -> list[int]:
    """The devices a program runs on, in its mesh's order (a program loads onto exactly these)."""
    for sharding in jax.tree.leaves(compiled.input_shardings):
        if isinstance(sharding, jax.sharding.NamedSharding):
            return [d.id for d in sharding.mesh.devices.flat]
    return [next(iter(jax.tree.leaves(compiled.input_shardings)[0].device_set)).id]


class _DevicePickler(pickle.Pickler):
    """Pickles the devices a program's argument tree names (a model split over a mesh) by their id."""

    def persistent_id(self, obj):
        return ("device", obj.id) if isinstance(obj, jax.Device) else None


class _DeviceUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        return {d.id: d for d in jax.devices()}[pid[1]]


def _prune(root: Path, keep: Path) -> None:
    """Delete the folders of other environments unused for a week; mark `keep` as used now."""
    if keep.exists():
        os.utime(keep)
    for folder in root.glob("*") if root.exists() else ():
        if folder != keep and folder.is_dir() and time.time() - folder.stat().st_mtime > STALE_AFTER_SECONDS:
            shutil.rmtree(folder, ignore_errors=True)
