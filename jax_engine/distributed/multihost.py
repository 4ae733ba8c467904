"""Several hosts: one JAX process per host, one global mesh, and the scheduler in the driver (node_rank 0).

JAX runs multi-host programs multi-controller: every process calls the same jitted programs in the same
order, each feeding its own devices, and XLA's collectives (gloo on CPU, NCCL on GPU) connect them inside the
programs. The engine is single-controller, as in vLLM: one scheduler, one block manager. So the driver
process runs the engine, and every worker process (`run_worker`) builds the same model runner and then
repeats the driver's device calls: before each one, the driver broadcasts the call (the runner method's name
and its host arguments, pickled) with `multihost_utils.broadcast_one_to_all`, itself a JAX collective. A
step's tensor-parallel all-reduces then run between the hosts inside the step program, as on one host.

    driver (node_rank 0)                          worker (node_rank 1, ...)
      scheduler -> StepInputs                         |
      broadcast ("execute", inputs) ---------------> receive
      runner.execute(inputs)  <== psums in the step ==>  runner.execute(inputs)
      runner.sample(...) -> tokens                    runner.sample(...) (its copy of the tokens unused)
"""

import atexit
import logging
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_engine.buckets import bucket

logger = logging.getLogger(__name__)

_SHUTDOWN = "shutdown"


def initialize(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> None:
    """Join the `nnodes` processes into one JAX runtime (vLLM's argument names), once per process.

    On CPU the collectives between processes go through gloo. Must run before anything asks JAX for its
    devices; the process of node_rank 0 is the coordinator and the driver.
    """
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"{master_addr}:{master_port}", num_processes=nnodes,
                               process_id=node_rank)
    logger.info("process %d of %d joined: %d devices in all, %d here", jax.process_index(), jax.process_count(),
                jax.device_count(), jax.local_device_count())


def _broadcast(message=None):
    """The driver's `message` on every process (the workers' own is ignored)."""
    payload = pickle.dumps(message) if jax.process_index() == 0 else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload))))
    buffer = np.zeros(bucket(size), np.uint8)  # sizes in powers of two: each shape compiles once
    buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
    return pickle.loads(multihost_utils.broadcast_one_to_all(buffer)[:size].tobytes())


def agree(values):
    """The driver's `values` on every process (sizes each host computes, which must be equal)."""
    return _broadcast(values)


class _StepOutput:
    """Stands, in a broadcast call, for one of the arrays the last `execute` returned (each process has its own)."""

    def __init__(self, index: int) -> None:
        self.index = index


class DriverRunner:
    """The driver's model runner: each device call is broadcast to the workers, then made here."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self._device_calls = runner.DEVICE_CALLS  # the methods that run device programs: the workers repeat them
        self._outputs: tuple = ()
        atexit.register(self.shutdown)

    def __getattr__(self, name: str):
        attribute = getattr(self._runner, name)
        if name not in self._device_calls:
            return attribute

        def call(*args):
            _broadcast((name, [self._wire(a) for a in args]))
            result = attribute(*args)
            if name == "execute":
                self._outputs = result
            return result

        return call

    def _wire(self, arg):
        """What a worker needs of a call's argument: host data; its own array for a step output."""
        for i, output in enumerate(self._outputs):
            if arg is output:
                return _StepOutput(i)
        if hasattr(arg, "sampling_seqs"):  # StepInputs: the sequences stay here, the arrays go
            return type(arg)(arg.token_ids, arg.lora_slots, arg.metadata, arg.logits_indices, [], [], {})
        if hasattr(arg, "swap_out"):  # SchedulerOutput: only the block moves
            return type(arg)(swap_out=arg.swap_out, swap_in=arg.swap_in, copies=arg.copies)
        return arg

    def shutdown(self) -> None:
        """Release the workers (at exit, or when the engine is done) and leave the JAX runtime with them."""
        if self._runner is not None:
            self._runner = None
            _broadcast((_SHUTDOWN, []))
            jax.distributed.shutdown()  # a barrier: the coordinator (this process) outlives every worker's exit


def run_worker(runner) -> None:
    """A worker process's loop: make every device call the driver makes, until it shuts down."""
    outputs: tuple = ()
    logger.info("worker %d serving the driver's device calls", jax.process_index())
    while True:
        name, args = _broadcast()
        if name == _SHUTDOWN:
            jax.distributed.shutdown()
            return
        args = [outputs[a.index] if isinstance(a, _StepOutput) else a for a in args]
        result = getattr(runner, name)(*args)
        if name == "execute":
            outputs = result
