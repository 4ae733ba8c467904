"""The LoRA adapters a server serves, each under its own model name, as vLLM serves them.

    jax-engine serve MODEL --enable-lora --lora-modules sql=/adapters/sql chat='{"name": "chat", "path": "..."}'
    POST /v1/completions {"model": "sql", ...}        the request runs with adapter "sql"; "model": MODEL, without
    GET  /v1/models                                   the base model, then each adapter (its "parent" the base)
    POST /v1/load_lora_adapter {"lora_name", "lora_path"}     with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true only
    POST /v1/unload_lora_adapter {"lora_name"}

An adapter named at start-up or loaded at run time is read and checked first (a bad one fails start-up, or gets a
400 naming the field); requests then queue with its LoRARequest. Unloading takes the name away at once and frees
the adapter once the requests already running with it finish.
"""

import json
import os

from jax_engine.lora.request import LoRARequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the load / unload routes


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules value: name=path, or vLLM's JSON form {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            module = json.loads(text)
            return str(module["name"]), str(module["path"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"--lora-modules {text!r}: a JSON module needs \"name\" and \"path\" ({error})") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object with name and path")
    return name, path


class ServedAdapters:
    """The server's adapters by model name; ids are handed out in order and never reused."""

    def __init__(self, engine, modules: tuple[tuple[str, str], ...], base_names: tuple[str, ...]) -> None:
        """`engine`: the AsyncLLMEngine (or DataParallelEngine); `modules` are read and checked now, before the
        engine loop starts (a bad one raises ValueError). `base_names`: the base model's, the first its own."""
        self._engine = engine
        self._base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        if modules and engine.engine.runner.lora is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path in modules:
            request = self.new_request(name, path)
            engine.engine.add_lora(request)
            self.by_name[name] = request

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest for a name not served yet (ValueError naming lora_name otherwise)."""
        if name in self._base_names or name in self.by_name:
            raise ValueError(f"lora_name: the lora adapter {name!r} has already been loaded")
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    def check(self, request: LoRARequest) -> None:
        """Read and check the adapter's files without touching the engine's state (safe while a step runs)."""
        self._engine.engine.runner.lora.check(request)

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name`: new requests cannot use it; the engine forgets it once its requests finish."""
        request = self.by_name.pop(name, None)
        if request is not None:
            self._engine.remove_lora(request.lora_int_id)
        return request

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """/v1/models entries, as vLLM lists adapters: the path as root, the base model as parent."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "jax-engine",
                 "root": request.lora_path, "parent": self._base_names[0], "max_model_len": max_model_len}
                for name, request in self.by_name.items()]
