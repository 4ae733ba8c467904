"""AsyncLLMEngine: LLMEngine driven by a background loop, for servers with many concurrent clients.

    client coroutines                         engine loop (one asyncio task)
    -----------------                         ------------------------------
    add_request() -> validate, queue  ----->  apply aborts, let queued requests in by tenant turns
                     (per tenant, fair_queue.py)                                   (event-loop thread)
    async for output in stream       <-----   engine.step() in a worker thread  (the loop stays free)
    cancelled / disconnected -> abort ----->  dispatch outputs to their streams

Only the loop task touches the engine's state, and only between steps, so no locks are needed: clients
append to plain lists that the loop drains before each step.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from jax_engine.beam_search import BeamSearchParams
from jax_engine.config import EngineArgs
from jax_engine.fair_queue import FairQueue, Tenant
from jax_engine.input_processor import Prompt
from jax_engine.lora.engine_methods import LORA_DISABLED
from jax_engine.lora.request import LoRARequest
from jax_engine.outputs import RequestOutput
from jax_engine.pooling_params import PoolingParams
from jax_engine.sampling_params import SamplingParams
from reference.scheduling_policy import check_priority

logger = logging.getLogger(__name__)


DEAD_MESSAGE = "the engine loop died; the server log has the details"


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the configured limit; the client should retry later."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (finish_reason "error"); the engine and the others go on."""


class GrammarFailedError(RequestFailedError):
    """One request's grammar stopped its output (a GrammarError in the engine: the grammar's doing, not the
    engine's). `field` is the request field the grammar came from; the message says why, after that field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


class RequestStream:
    """The outputs of one request as they arrive; iterate with `async for`. Leaving the loop early (the client
    went away, the task was cancelled) aborts the request, which frees its KV blocks."""

    def __init__(self, request_id: str, engine: "AsyncLLMEngine", grammar_field: str | None = None) -> None:
        self.request_id = request_id
        self._engine = engine
        self.grammar_field = grammar_field  # the field its grammar came from (errors about the grammar name it)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self._engine.abort(self.request_id)


class AsyncLLMEngine:
    """Continuous batching for concurrent callers: each `generate` streams its own outputs.

    Args:
        engine: the engine to drive: an LLMEngine, or an EngineCoreClient (the engine in a core process).
        max_waiting_requests: add_request raises QueueFullError while this many requests wait to start
            (None: no limit).
        max_waiting_per_tenant: the same for one tenant's requests (None: no limit of its own).

    Requests enter the engine by tenant turns (fair_queue.py): while several tenants have work, each holds at
    most its share of max_num_seqs sequences in the engine, and the rest of its requests wait outside it.
    """

    def __init__(self, engine, max_waiting_requests: int | None = None,
                 max_waiting_per_tenant: int | None = None) -> None:
        self.engine = engine
        self._remote = hasattr(engine, "next_outputs")  # an EngineCoreClient: the engine is in another process
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.on_output: Callable[[RequestOutput], None] | None = None  # e.g. metrics, called per output
        self.on_dead: Callable[[], None] | None = None  # e.g. the server shutting down, called once
        self.dead_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._new: FairQueue[tuple] = FairQueue()  # (prompt, params, lora_request, priority) by tenant
        self._in_engine: dict[str, tuple[Tenant, int]] = {}  # requests let in: their tenant and sequences
        self._aborts: set[str] = set()
        self._lora_removals: set[int] = set()  # adapters to forget once no request uses them
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> "AsyncLLMEngine":
        from jax_engine.llm_engine import LLMEngine  # JAX, which an API server of an engine core never imports
        return cls(LLMEngine(args), **kwargs)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine loop on the running event loop (done by the first add_request too)."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run_loop(), name="engine-loop")

    async def stop(self) -> None:
        """Stop the loop after its current step; unfinished requests are aborted."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError("the engine was shut down"))
        self._streams.clear()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.dead_error is None

    def num_waiting_requests(self) -> int:
        return len(self._new) + (self.engine.num_waiting_sequences() if self._remote
                                 else len(self.engine.scheduler.waiting))

    def num_waiting_of(self, tenant: Tenant) -> int:
        """Requests of `tenant` waiting to enter the engine."""
        return self._new.count(tenant)

    def num_running_requests(self) -> int:
        return self.engine.num_running_sequences() if self._remote else len(self.engine.scheduler.running)

    # ------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | BeamSearchParams | None = None,
                    tenant: Tenant = None, lora_request: LoRARequest | None = None, priority: int = 0) -> RequestStream:
        """Validate and queue a request now (ValueError, QueueFullError, EngineDeadError are raised here,
        before any output), and return the stream of its outputs. `tenant` (an API key's name) is whose turn
        it waits for; `lora_request` the adapter it runs with; `priority` its place in the engine's queues."""
        params = params or self.engine.get_default_sampling_params()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lora_request is not None and self.engine.runner.lora is None:
            raise ValueError(LORA_DISABLED)
        self.check_accepting(tenant)
        check_priority(priority, self.engine.scheduler_config.policy)
        text, token_ids, params = self.engine.validate_request(prompt, params)  # the engine's copy: checked once
        self.start()
        grammar = getattr(params, "compiled_grammar", None)
        stream = self._streams[request_id] = RequestStream(request_id, self, grammar and grammar.field)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        prompt = {"prompt": text, "prompt_token_ids": token_ids, "cache_salt": salt}
        self._new.push(tenant, request_id, (prompt, params, lora_request, priority), priority)
        self._wakeup.set()
        return stream

    def check_accepting(self, tenant: Tenant = None) -> None:
        """Raise EngineDeadError or QueueFullError if a new request (of `tenant`) would be refused now (cheap:
        call it before tokenizing)."""
        if self.dead_error is not None:
            raise self._dead()
        if self.max_waiting_requests is not None and self.num_waiting_requests() >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting_requests()} requests are waiting (limit "
                                 f"{self.max_waiting_requests}); retry later")
        waiting = self.num_waiting_of(tenant)
        if self.max_waiting_per_tenant is not None and waiting >= self.max_waiting_per_tenant:
            raise QueueFullError(f"{waiting} requests of this API key are waiting (limit "
                                 f"{self.max_waiting_per_tenant} per key); retry later")

    def _dead(self) -> EngineDeadError:
        """The error new and in-flight requests get: the cause is chained for Python callers, and its text
        (which may be anything) stays out of the message that servers pass on to clients."""
        error = EngineDeadError(DEAD_MESSAGE)
        error.__cause__ = self.dead_error
        return error

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | BeamSearchParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """vLLM's AsyncLLMEngine.generate: yield the request's RequestOutput after every step it progressed."""
        async for output in self.add_request(request_id, prompt, sampling_params):
            yield output

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (at the loop's next turn); unknown ids are ignored."""
        self._streams.pop(request_id, None)
        if not self._new.remove(request_id):
            self._aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    # ---------------------------------------------------------------------------- engine loop
    async def _run_loop(self) -> None:
        try:
            while True:
                if not self._new and not self._aborts and not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                self._apply_queued()
                self._dispatch(await self._next_outputs())
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the engine is in an unknown state: fail every request, loudly
            logger.exception("the engine loop died")
            self.dead_error = error
            for stream in self._streams.values():
                stream.put(self._dead())
            self._streams.clear()
            if self.on_dead is not None:
                self.on_dead()

    async def _next_outputs(self) -> list[RequestOutput]:
        """A step of the engine in a worker thread (the loop stays free); or, with the engine in a process of its
        own (EngineCoreClient), its next outputs or [] as soon as there is new work to send it."""
        if not self._remote:
            return await asyncio.to_thread(self.engine.step)
        self._wakeup.clear()
        return await self.engine.next_outputs(self._wakeup)

    def remove_lora(self, lora_id: int) -> None:
        """Forget adapter `lora_id` once no request uses it (at a loop turn: between steps, never during one)."""
        self._lora_removals.add(lora_id)
        self.start()
        self._wakeup.set()

    def _apply_queued(self) -> None:
        for lora_id in list(self._lora_removals):
            if not self.engine.lora_users(lora_id):
                self.engine.remove_lora(lora_id)
                self._lora_removals.discard(lora_id)
        aborts, self._aborts = self._aborts, set()
        self.engine.abort_request(list(aborts))
        for request_id in aborts:
            self._in_engine.pop(request_id, None)
        while (entry := self._new.pop_next(self._may_enter)) is not None:
            tenant, request_id, (prompt, params, lora_request, priority) = entry
            try:
                self.engine.add_request(request_id, prompt, params, lora_request=lora_request, priority=priority)
                self._in_engine[request_id] = (tenant, _num_sequences(params))
            except ValueError as error:  # checked at add time; only a race could get here, and it hurts no one
                self._streams.pop(request_id).put(error)
            except Exception:  # a fault of this request alone
                logger.exception("request %s could not be added", request_id)
                self._streams.pop(request_id).put(RequestFailedError(request_id))

    def _may_enter(self, tenant: Tenant) -> bool:
        """Whether `tenant`'s next request may enter the engine now: while it holds fewer sequences there than
        its share of max_num_seqs, or the engine holds fewer than max_num_seqs in all (nobody else is asking:
        the turns go in order). A tenant holding none always may: a request of n > share still runs."""
        held = sum(seqs for owner, seqs in self._in_engine.values() if owner == tenant)
        active = self._new.tenants | {owner for owner, _ in self._in_engine.values()}
        limit = self.engine.scheduler_config.max_num_seqs
        in_engine = sum(seqs for _, seqs in self._in_engine.values())
        return held == 0 or held < max(limit // len(active), 1) or in_engine < limit

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                self._in_engine.pop(output.request_id, None)
            if self.on_output is not None:
                self.on_output(output)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            failed = (output.finished and isinstance(output, RequestOutput)  # a pooled output cannot fail
                      and any(c.finish_reason == "error" for c in output.outputs))
            stream.put(_failure(output, stream.grammar_field) if failed else output)
            if output.finished:
                del self._streams[output.request_id]


def _failure(output: RequestOutput, grammar_field: str | None) -> RequestFailedError:
    """What a failed request raises: its grammar's error if the grammar stopped it (the engine puts the
    GrammarError's message in that completion's stop_reason), else RequestFailedError."""
    reasons = [c.stop_reason for c in output.outputs if c.finish_reason == "error" and isinstance(c.stop_reason, str)]
    if reasons and grammar_field is not None:
        return GrammarFailedError(grammar_field, reasons[0])
    return RequestFailedError(output.request_id)


def _num_sequences(params: SamplingParams | BeamSearchParams | PoolingParams) -> int:
    if isinstance(params, PoolingParams):
        return 1
    return params.beam_width if isinstance(params, BeamSearchParams) else params.n
