"""Data parallelism (vLLM's data_parallel_size): N engine replicas behind one server.

Each replica is a whole AsyncLLMEngine (its own scheduler, KV cache and engine loop) on its own
tensor_parallel_size devices, replica r on devices [r * tp, (r + 1) * tp). `jax-engine serve` runs each in an
engine core process of its own (`in_core_processes`, as vLLM runs a core per data-parallel rank); with
--no-engine-core-process they share the server's process and the loaded checkpoint's host arrays.
DataParallelEngine is the front: it offers the server AsyncLLMEngine's API, sends each new request to the
replica with the fewest unfinished requests, and routes aborts to the replica that holds the request.
Throughput grows with the replicas; a request's latency is that of one replica.
"""

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from jax_engine.async_llm_engine import AsyncLLMEngine, QueueFullError, RequestStream
from jax_engine.beam_search import BeamSearchParams
from jax_engine.config import EngineArgs
from jax_engine.input_processor import Prompt
from jax_engine.loader import Checkpoint, load_engine_checkpoint
from jax_engine.lora.request import LoRARequest
from jax_engine.outputs import RequestOutput
from jax_engine.sampling_params import SamplingParams


class DataParallelEngine:
    """AsyncLLMEngine's API over several replicas (see the module docstring); a drop-in for the server.

    `.engine` is replica 0's LLMEngine: the replicas share the model, so its tokenizer, configs and request
    validation hold for all; /metrics reads every replica (server/metrics.py).
    `max_waiting_requests` limits the requests waiting in all replicas together. When one replica's loop dies,
    the server is told (`on_dead`) and refuses new requests, as with a single engine.
    """

    def __init__(self, replicas: list[AsyncLLMEngine], max_waiting_requests: int | None = None,
                 max_waiting_per_tenant: int | None = None) -> None:
        self.replicas = replicas
        self.engine = replicas[0].engine
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.on_output: Callable[[RequestOutput], None] | None = None
        self.on_dead: Callable[[], None] | None = None
        self._replica_of: dict[str, AsyncLLMEngine] = {}  # unfinished requests' replicas
        self._told_dead = False
        for replica in replicas:
            replica.on_output = self._replica_output
            replica.on_dead = self._replica_died

    @classmethod
    def from_engine_args(cls, args: EngineArgs, checkpoint: Checkpoint | None = None,
                         **kwargs) -> "DataParallelEngine":
        """Load the checkpoint once and build args.data_parallel_size replicas of it, in this process."""
        # Imported here: the in-process engine imports JAX, which a server of engine core processes never needs.
        from jax_engine.distributed.replica_devices import replica_devices
        from jax_engine.llm_engine import LLMEngine

        devices = replica_devices(args)  # before the slow part
        checkpoint = checkpoint or load_engine_checkpoint(args)
        return cls([AsyncLLMEngine(LLMEngine(args, checkpoint, devices=d)) for d in devices], **kwargs)

    @classmethod
    def in_core_processes(cls, args: EngineArgs, log_level: str = "INFO", **kwargs) -> "DataParallelEngine":
        """Each replica in an engine core process of its own (jax_engine/engine_core/), on its own devices; the
        processes start and load at once. Each loads the checkpoint itself."""
        from jax_engine.engine_core.core_client import EngineCoreClient

        with ThreadPoolExecutor(args.data_parallel_size) as pool:
            starting = [pool.submit(EngineCoreClient, args, log_level, replica=r)
                        for r in range(args.data_parallel_size)]
        failed = next((f.exception() for f in starting if f.exception() is not None), None)
        if failed is not None:  # the others stop too
            for started in (f.result() for f in starting if f.exception() is None):
                started.shutdown()
            raise failed
        return cls([AsyncLLMEngine(f.result()) for f in starting], **kwargs)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    async def stop(self) -> None:
        await asyncio.gather(*(replica.stop() for replica in self.replicas))

    @property
    def is_running(self) -> bool:
        return all(replica.is_running for replica in self.replicas)

    @property
    def dead_error(self) -> BaseException | None:
        return next((r.dead_error for r in self.replicas if r.dead_error is not None), None)

    def num_waiting_requests(self) -> int:
        return sum(replica.num_waiting_requests() for replica in self.replicas)

    def num_running_requests(self) -> int:
        return sum(replica.num_running_requests() for replica in self.replicas)

    # ------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | BeamSearchParams | None = None,
                    tenant: str | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> RequestStream:
        """Queue the request on the least loaded replica (see AsyncLLMEngine.add_request)."""
        if request_id in self._replica_of:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_accepting(tenant)
        replica = min(self.replicas, key=_unfinished)  # ties: the lowest index
        stream = replica.add_request(request_id, prompt, params, tenant, lora_request, priority)
        stream._engine = self  # a stream left early aborts through the front, which then forgets the request
        self._replica_of[request_id] = replica
        return stream

    def remove_lora(self, lora_id: int) -> None:
        for replica in self.replicas:
            replica.remove_lora(lora_id)

    def check_accepting(self, tenant: str | None = None) -> None:
        for replica in self.replicas:
            replica.check_accepting()  # a dead replica raises EngineDeadError (the replicas have no queue limit)
        waiting = self.num_waiting_requests()
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{waiting} requests are waiting (limit {self.max_waiting_requests}); retry later")
        waiting = sum(replica.num_waiting_of(tenant) for replica in self.replicas)
        if self.max_waiting_per_tenant is not None and waiting >= self.max_waiting_per_tenant:
            raise QueueFullError(f"{waiting} requests of this API key are waiting (limit "
                                 f"{self.max_waiting_per_tenant} per key); retry later")

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | BeamSearchParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        async for output in self.add_request(request_id, prompt, sampling_params):
            yield output

    def abort(self, request_id: str) -> None:
        replica = self._replica_of.pop(request_id, None)
        if replica is not None:
            replica.abort(request_id)

    # ---------------------------------------------------------------------- replica callbacks
    def _replica_output(self, output: RequestOutput) -> None:
        if output.finished:
            self._replica_of.pop(output.request_id, None)
        if self.on_output is not None:
            self.on_output(output)

    def _replica_died(self) -> None:
        if not self._told_dead and self.on_dead is not None:
            self._told_dead = True
            self.on_dead()


def _unfinished(replica: AsyncLLMEngine) -> int:
    """Requests a replica holds: just added, waiting and running."""
    return replica.num_waiting_requests() + replica.num_running_requests()
