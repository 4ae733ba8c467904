"""Python's garbage collector at start-up and while serving (vLLM's vllm/utils/gc_utils.py).

Start-up makes millions of objects that all live on: the modules of JAX, Flax, transformers and the engine,
the tokenizer's tables, the model's tree. Every 700 new objects the collector walks the young ones, and every
few of those walks the older generations too, finding nothing to free: a tenth of a warm `jax-engine serve`
start went there. So start-up runs with the collector paused, and a serving process then collects once and
freezes what is left (`gc.freeze`: moved to a generation that no collection walks again), so that the pauses
of serving walk only what serving makes.
"""

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """No automatic collection inside (objects are still freed by reference counting); the collector is as it
    was after. Nested uses leave it paused until the outermost ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze() -> None:
    """Collect start-up's garbage once, keep every object alive now out of later collections, and collect
    automatically from here on: for a serving process, once it is ready. (A library's caller keeps its own
    collector: LLM only pauses it while the engine builds.)"""
    gc.collect()
    gc.freeze()
    gc.enable()
