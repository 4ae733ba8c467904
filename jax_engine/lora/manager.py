"""The adapters an engine serves: an LRU cache of them in host memory, and `max_loras` slots on the device.

    add_request(lora_request) -> load()      read and check the PEFT directory (once: host LRU of max_cpu_loras)
    scheduler                                admits a request only while the running requests use at most
                                             max_loras adapters, its own included (else it waits)
    runner.prepare(step) -> activate()       every adapter of the step in a slot: a missing one replaces the
                                             least recently used adapter that this step does not use
    step                                     each token carries its adapter's slot (-1: none)

vLLM's LRUCacheWorkerLoRAManager, in one class. Writing a slot replaces its stacks' values, never their shapes
(jax_engine/lora/layout.py), so a new adapter costs a copy of the stacks to the device, and no compile.
"""

import collections
import logging
from dataclasses import dataclass

import numpy as np

from jax_engine.loader.lora import load_lora_adapter
from jax_engine.lora.layout import LoRALayout
from jax_engine.lora.request import LoRARequest
from reference.lora import LoRAAdapter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterChecker:
    """What reading and checking an adapter needs of the base model, and no more: it pickles, so an engine core's
    API server checks adapters itself (jax_engine/engine_core/)."""

    module_shapes: dict[str, tuple[int, int]]
    max_rank: int
    dtype: str  # the device slots': an adapter's values must be finite in it

    def check(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of `request` read from its directory; ValueError naming the field if it does not fit."""
        return load_lora_adapter(request.lora_path, self.module_shapes, request.lora_name, self.max_rank, self.dtype)


class LoRAManager:
    """Host and device copies of the adapters of one model (CausalLM with add_lora_slots)."""

    def __init__(self, model, max_cpu_loras: int) -> None:
        self.model = model
        self.layout: LoRALayout = model.lora_layout
        self.max_cpu_loras = max_cpu_loras
        self.requests: dict[int, LoRARequest] = {}  # every adapter added and not removed, by id
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()  # by id, LRU first
        self.slots: list[int | None] = [None] * self.layout.max_loras  # the adapter id in each device slot
        self._last_used = [0] * self.layout.max_loras  # the activation count at each slot's last use
        self._activations = 0
        self.writes = 0  # slots written: each replaces arrays of the model (runner/flat_model.py)
        # The stacks' host copy, in the whole model's layout: a slot is written here, then every stack is placed
        # (split over the devices under tensor parallelism). A scatter on the device would be a program to
        # compile per stack shape.
        self._dtype = model.lora[next(iter(model.lora.keys()))][...].dtype
        self.checker = AdapterChecker(self.layout.module_shapes(), self.layout.max_rank, self._dtype.name)
        self._stacks = {name: np.zeros(shape, self._dtype) for name, shape in self.layout.stack_shapes().items()}

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of `request`, from the host cache or read from its directory (then checked against the
        base model; ValueError naming the field if it does not fit)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        for known in self.requests.values():
            if (known.lora_name == request.lora_name) != (known.lora_int_id == request.lora_int_id):
                raise ValueError(f"LoRA adapter {known.lora_name!r} has lora_int_id {known.lora_int_id}; got "
                                 f"{request.lora_name!r} with lora_int_id {request.lora_int_id}: one name, one id")
        if request.lora_int_id in self._host:
            self._host.move_to_end(request.lora_int_id)
            return self._host[request.lora_int_id]
        adapter = self.checker.check(request)
        self.requests[request.lora_int_id] = request
        self._host[request.lora_int_id] = adapter
        while len(self._host) > self.max_cpu_loras:
            evicted, _ = self._host.popitem(last=False)
            logger.info("LoRA adapter %d left the host cache (max_cpu_loras=%d)", evicted, self.max_cpu_loras)
        return adapter

    def check(self, request: LoRARequest) -> None:
        """Read and check an adapter's files, keeping nothing: safe beside a running step (a server's thread)."""
        self.checker.check(request)

    def remove(self, lora_id: int, users: list[str]) -> bool:
        """Forget an adapter (its name, host copy and device slot): False if unknown, a ValueError if `users` (the
        unfinished requests that run with it) is not empty."""
        request = self.requests.get(lora_id)
        if request is None:
            return False
        if users:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is in use by {len(users)} unfinished requests "
                             f"({users[:3]}); abort them or wait for them first")
        del self.requests[lora_id]
        self._host.pop(lora_id, None)
        if lora_id in self.slots:
            self._write(self.slots.index(lora_id), None)
        return True

    def activate(self, requests: set[LoRARequest]) -> dict[int, int]:
        """Put every adapter of a step in a device slot; returns the slot of each adapter id. The scheduler keeps a
        step's adapters within max_loras, so each missing one finds a slot that this step does not use."""
        self._activations += 1
        needed = {r.lora_int_id for r in requests}
        for request in sorted(requests, key=lambda r: r.lora_int_id):
            if request.lora_int_id not in self.slots:
                free = [s for s, held in enumerate(self.slots) if held not in needed]
                slot = min(free, key=lambda s: (self.slots[s] is not None, self._last_used[s]))
                self._write(slot, request)
        slot_of = {adapter_id: slot for slot, adapter_id in enumerate(self.slots) if adapter_id in needed}
        for slot in slot_of.values():
            self._last_used[slot] = self._activations
        return slot_of

    def _write(self, slot: int, request: LoRARequest | None) -> None:
        """Slot `slot` of every stack holds `request`'s adapter (zeros for None)."""
        adapter = None if request is None else self.load(request)
        for name, values in self.layout.slot_arrays(adapter, self._dtype).items():
            self._stacks[name][:, slot] = values
        self.model.write_lora_stacks(self._stacks)
        self.writes += 1
        self.slots[slot] = None if request is None else request.lora_int_id
        logger.info("LoRA slot %d now holds %s", slot, "nothing" if request is None else request.lora_name)
