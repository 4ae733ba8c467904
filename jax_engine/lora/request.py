"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`, same fields)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory under a name and a positive integer id, both unique among the engine's adapters.

    Two requests with the same name use the same adapter: it is loaded once, shares a device slot and shares
    cached prefix blocks, which no other adapter (or the base model) reads.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got {self.lora_path!r}")

    # vLLM's short names
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
