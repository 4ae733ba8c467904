"""The LoRA methods of vLLM's LLMEngine (add_lora, remove_lora, list_loras), which LLMEngine takes from here: they
delegate to the runner's LoRAManager (manager.py), and look at the engine's unfinished requests for an adapter's
users."""

from typing import TYPE_CHECKING

from jax_engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from jax_engine.runner.model_runner import ModelRunner
    from jax_engine.sequence_group import SequenceGroup

LORA_DISABLED = "lora_request needs an engine started with enable_lora=True (--enable-lora)"


class LoRAEngineMethods:
    runner: "ModelRunner"
    _groups: dict[str, "SequenceGroup"]  # the engine's unfinished requests

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now, so that requests for it start without the wait (ValueError if bad)."""
        if self.runner.lora is None:
            raise ValueError(LORA_DISABLED)
        self.runner.lora.load(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter `lora_id`: False if unknown; a ValueError while unfinished requests use it."""
        return self.runner.lora is not None and self.runner.lora.remove(lora_id, self.lora_users(lora_id))

    def lora_users(self, lora_id: int) -> list[str]:
        """The unfinished requests that run with adapter `lora_id`."""
        return [g.request_id for g in self._groups.values() if getattr(g.lora_request, "lora_int_id", 0) == lora_id]

    def list_loras(self) -> set[int]:
        return set() if self.runner.lora is None else set(self.runner.lora.requests)
