"""The API servers of `--api-server-count N` start accepting together, once every one of them is ready.

They share one listening socket, and the kernel hands each connection to a process that is accepting: the first
API server ready took every connection until the others had started (a second or more, each importing the server
and joining the engine core), and /health answered 200 from it meanwhile. So each API server, once its engine is
ready, says so on a pipe and waits for the end of file of another; the supervisor closes that one when all N have
said so (or when it stops them), which wakes them all at once.
"""

import os
import select
import time


class StartBarrier:
    """The supervisor's side: two pipes whose child ends (`child_fds`) each API server is given."""

    def __init__(self, count: int) -> None:
        self.count, self.ready = count, 0
        self._ready_read, ready_write = os.pipe()
        go_read, self._go_write = os.pipe()
        self.child_fds = (ready_write, go_read)

    def started(self) -> None:
        """Close this process's copies of the child ends (the API servers have theirs)."""
        for fd in self.child_fds:
            os.close(fd)

    def wait(self, seconds: float) -> None:
        """Count the API servers that said they are ready, for at most `seconds`; release them once all have."""
        if self.released:
            time.sleep(seconds)
            return
        if not select.select([self._ready_read], [], [], seconds)[0]:
            return
        said = os.read(self._ready_read, self.count)
        self.ready += len(said)
        if self.ready >= self.count or not said:  # all ready, or all gone (end of file)
            self.release()

    @property
    def released(self) -> bool:
        return self._go_write is None

    def release(self) -> None:
        if self._go_write is not None:
            os.close(self._go_write)
            self._go_write = None

    def close(self) -> None:
        self.release()
        os.close(self._ready_read)


def wait_for_the_others(child_fds: tuple[int, int]) -> None:
    """An API server's side, once its engine is ready: say so, then wait until every API server has."""
    ready_write, go_read = child_fds
    os.write(ready_write, b".")
    os.close(ready_write)
    os.read(go_read, 1)  # end of file: the supervisor released every API server
    os.close(go_read)
