"""Request bodies of vLLM's routes beside the OpenAI API: /tokenize, /detokenize, the run-time LoRA adapter
updates and the demo /generate."""

from pydantic import BaseModel, ConfigDict, Field

from jax_engine.server.json_fields import Text
from jax_engine.server.protocol import CONTINUE_FINAL_MESSAGE, RequestBody
from jax_engine.server.request_parts import ChatMessage


class TokenizeRequest(RequestBody):
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description=CONTINUE_FINAL_MESSAGE)
    model: str | None = None


class DetokenizeRequest(RequestBody):
    tokens: list[int]
    model: str | None = None


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; the name alone picks the adapter


class GenerateRequest(BaseModel):
    """The simple demo server's body: a prompt, `stream`, and any SamplingParams field by name."""

    model_config = ConfigDict(extra="allow", strict=True)
    prompt: Text
    stream: bool = False
