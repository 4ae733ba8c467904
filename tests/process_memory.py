"""Hand freed memory back to the system, so that what a process holds is what it uses."""

import ctypes
import gc


def release_freed_memory() -> None:
    """Collect unreachable objects, then return the heap pages glibc keeps for reuse (other C libraries keep
    theirs): without the second step a process's resident memory counts memory it has already freed."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
