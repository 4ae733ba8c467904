"""Requests whose grammar the engine core is building, off its loop.

An llguidance matcher cannot be pickled, so the core builds each request's matcher again from the grammar's text
(checked in the API server's grammar worker). That build takes up to the worker's 5 s (a schema of 3,000 optional
properties: 0.8 s) and the prototype's first mask up to ~0.8 s (a 500,000-character const). On the core's loop it
stopped every other request's steps for that long; here it runs in a thread of its own (llguidance releases the
GIL) while the loop steps, and the request joins the engine once its grammar is ready.
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from jax_engine.engine_core.messages import AddRequest
from jax_engine.structured_output.grammar import CompiledGrammar

# How often an otherwise idle core looks for finished builds.
BUILD_POLL_MS = 5


class GrammarBuilds:
    """Build grammars in a thread, one at a time, in the order their requests came."""

    def __init__(self, build: Callable[[str], CompiledGrammar], prepare: Callable[[], None]) -> None:
        self._build, self._prepare = build, prepare
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-build")
        self._pending: dict[str, tuple[int, AddRequest, Future]] = {}  # request id -> (API server, request, build)
        self._aborted: set[str] = set()  # pending requests aborted meanwhile (they join the engine aborted)
        self.prepare()

    def prepare(self) -> None:
        """GrammarCompiler.prepare (the library's tokenizer) in the thread, before any build that comes after."""
        self._pool.submit(self._prepare)

    def submit(self, server: int, request: AddRequest) -> None:
        self._pending[request.request_id] = (server, request, self._pool.submit(self._build, request.grammar_text))

    def abort(self, request_ids: list[str]) -> None:
        self._aborted.update(r for r in request_ids if r in self._pending)

    def ready(self) -> list[tuple[int, AddRequest, Future, bool]]:
        """(API server, request, build, whether it was aborted meanwhile) for each request whose build has finished
        (successfully or not), in the order they came."""
        finished = []
        for request_id in [r for r, (_, _, build) in self._pending.items() if build.done()]:
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)
            finished.append((*self._pending.pop(request_id), aborted))
        return finished

    def __len__(self) -> int:
        return len(self._pending)
