"""C++ XLA FFI kernels: built with the system compiler on first use, cached per source, jaxlib and CPU.

The engine's CPU kernels (paged attention, the few-rows matmul) are single C++ files against XLA's FFI
headers, which jaxlib ships. Each is compiled once per machine into JAX_ENGINE_CACHE_DIR (default
~/.cache/jax_engine) and registered as a custom-call target; without a compiler the callers fall back to
plain XLA and say why in the log.
"""

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

INCLUDE_DIR = Path(__file__).parent / "native_include"  # headers the kernels share (float16.h)

# -ffast-math lets the dot products vectorize; it is a compile flag only: linking with it would add
# crtfastmath.o, which flushes denormals to zero for the whole process the moment the library loads.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC")


def cache_dir() -> Path:
    return Path(os.environ.get("JAX_ENGINE_CACHE_DIR") or Path.home() / ".cache" / "jax_engine")


def cpu_signature() -> str:
    """-march=native code must not run on another CPU: the cache key includes this one's feature flags."""
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0] if flags else ""
    except OSError:
        return ""


def library_path(source: Path) -> Path:
    headers = [h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    parts = [source.read_bytes(), *headers, " ".join(COMPILE_FLAGS).encode(), jaxlib.__version__.encode(),
             cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def _compile(source: Path, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:  # build aside, then rename: atomic for others
        built, obj = Path(tmp) / library.name, Path(tmp) / f"{source.stem}.o"
        for command in ([compiler, *COMPILE_FLAGS, "-I", jax.ffi.include_dir(), "-I", str(INCLUDE_DIR), "-c", str(source), "-o", str(obj)],
                        [compiler, "-shared", str(obj), "-o", str(built)]):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)


def register_kernel(source: Path, symbol: str, target: str, log) -> str | None:
    """Build `source` (once per machine) and register its handler `symbol` as the FFI target `target`.

    Returns None when it is ready, else why it is not (OSError, or the compiler's message).
    """
    try:
        library = library_path(source)
        if not library.exists():
            log.info("compiling %s into %s", source.name, library)
            _compile(source, library)
        handler = getattr(ctypes.cdll.LoadLibrary(str(library)), symbol)
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"
    return None
