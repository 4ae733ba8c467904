"""Engine arguments (vLLM's names and defaults) and what they resolve to on this machine."""

import argparse
import dataclasses
import json
import re
import typing
from dataclasses import dataclass

from jax_engine.arg_choices import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS
from jax_engine.model_config import ModelConfig
from jax_engine.pooling_params import check_task_args
from jax_engine.sampling_params import MAX_LOGPROBS, check_generation_overrides
from jax_engine.models.rope_scaling import max_len_with_rope_scaling
from jax_engine.spec_decode import SpeculativeConfig
from reference.scheduler import PREEMPTION_MODES, SchedulerConfig
from reference.scheduling_policy import SCHEDULING_POLICIES

# vLLM's values that mean what this engine does; its others (slow or Mistral tokenizers, PyTorch .bin files,
# dummy weights, ...) are refused by name rather than ignored.
TOKENIZER_MODES = ("auto", "hf")
LOAD_FORMATS = ("auto", "safetensors", "gguf")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
ATTENTION_SELF_TESTS = ("auto", "fallback", "error", "off")


@dataclass
class EngineArgs:
    """Everything `LLM(...)` and `jax-engine` accept. Invalid values raise ValueError naming the argument.

    Args:
        model: a .gguf file, an HF checkpoint directory or a hub name already in the HF cache (never
            downloaded: jax_engine/loader/hub_cache.py); None loads SmolLM2-135M-Instruct.
        download_dir: vLLM's; the HF cache a hub name is read from (default: HF's own, ~/.cache/huggingface/hub).
        revision: vLLM's; the branch, tag or commit of a hub name's snapshot (default: "main").
        tokenizer_revision: vLLM's; the same for a hub name given as the tokenizer.
        dtype: "auto" (float32 on CPU, bfloat16 on GPU), "float32", "bfloat16" or "float16".
        block_size: tokens per KV block; None picks the attention backend's default (64 for cpu, else 16).
        max_model_len: longest prompt + output; None uses the model's own limit.
        max_num_seqs: most sequences in one step.
        max_logprobs: the most logprobs (and prompt_logprobs) a request may ask for, as vLLM's; at most 20, the
            top log-probabilities the compiled sampler keeps (vLLM's -1, no limit, is refused).
        max_num_batched_tokens: most tokens in one step; None picks 2048 (or max_model_len without
            chunked prefill).
        kv_cache_memory_bytes: KV cache size; None means 2 GiB on CPU, or gpu_memory_utilization on GPU.
        kv_cache_dtype: "auto" (the model's dtype), "bfloat16", or "fp8" (= "fp8_e4m3") / "fp8_e5m2": keys and
            values stored in half or a quarter of a float32 model's bytes, so the cache holds 2x or 4x the tokens
            and attention reads that much less; 8-bit values saturate at the format's largest (scale 1.0).
        gpu_memory_utilization: fraction of accelerator memory for weights, activations and KV cache.
        num_gpu_blocks_override: exact number of KV blocks, ignoring the memory budget.
        enable_prefix_caching: reuse the KV blocks of shared prompt prefixes.
        enable_chunked_prefill: split long prompts across steps, mixed with decodes.
        preemption_mode: "recompute" or "swap", when the cache runs out.
        scheduling_policy: "fcfs" (first come, first served) or "priority": requests then run in order of the
            priority each is given (add_request's, generate's), lowest first, and the lowest-priority running
            request is preempted first (vLLM's policy); arrival breaks ties.
        swap_space: GiB of host memory for swapped-out blocks.
        attention_backend: "auto", "xla", "cpu" (a C++ paged-attention kernel, ragged) or "pallas".
        attention_self_test: whether start-up first runs the Pallas kernels once against the xla path, on a small
            random step of the model's shapes (heads, head dim, sliding window, ALiBi slopes, cache dtype, block
            size), and what a difference past the tolerance does (jax_engine/runner/attention_self_test.py):
            "auto" tests them where they run compiled (a GPU) and serves on xla if they differ, with a warning
            naming the difference; "fallback" does so wherever the backend is pallas (interpreted on CPU too);
            "error" tests them there and stops with an error instead; "off" never tests.
        seed: seed for requests that do not set their own.
        quantization: weight-only quantization of the matmul weights: "bf16", "int8" (one scale per output
            feature), "gguf" (a .gguf model's Q8_0/Q4_0/Q4_1/Q5_0 blocks kept as the file has them, vLLM's
            name), or None to keep them in dtype (a GGUF file's blocks are then dequantized).
        enforce_eager: compile each step shape on first use (a stall mid-stream) instead of compiling or
            loading every one at start-up (jax_engine/runner/compile_shapes.py), as vLLM's flag skips CUDA graphs.
        compilation_cache_dir: where compiled programs are kept between runs; "auto" is
            $JAX_ENGINE_CACHE_DIR/compiled (~/.cache/jax_engine/compiled), "" keeps nothing.
        generation_config: where requests' default sampling parameters come from: "auto", the model's
            generation_config.json (vLLM's default); "vllm", vLLM's own defaults; or a directory holding one.
        override_generation_config: generation config values on top of those (vLLM's), e.g. {"temperature":
            0.5, "max_new_tokens": 64}: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens.
        tensor_parallel_size: devices each layer is split over, Megatron-style (jax_engine/distributed/); on
            several hosts, the devices of all of them.
        data_parallel_size: engine replicas, each on its own tensor_parallel_size devices, behind one server
            (`jax-engine serve`); requests go to the replica with the fewest unfinished requests
            (jax_engine/server/data_parallel.py).
        nnodes: processes (hosts) the devices come from; with more than one, node_rank 0 runs the engine and
            the others run `jax-engine serve --headless` (jax_engine/distributed/multihost.py).
        node_rank: this process's rank among the nnodes.
        master_addr: the address of node_rank 0, where JAX's coordinator listens.
        master_port: the port of JAX's coordinator.
        speculative_config: speculative decoding, vLLM's dictionary (a JSON object on the command line), e.g.
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4} or a draft model,
            {"model": "self", "quantization": "int8", "num_speculative_tokens": 3}; see
            jax_engine/spec_decode/config.py. None decodes one token per step.
        enable_lora: serve LoRA adapters (PEFT directories) beside the base model, requests choosing theirs with a
            LoRARequest (jax_engine/lora/).
        max_loras: adapters that can run in one batch: the device slots, each max_lora_rank wide.
        max_lora_rank: the highest adapter rank r accepted; slots are this wide, so it sets their memory.
        max_cpu_loras: adapters kept in host memory, ready for a slot; None means max_loras.
        skip_tokenizer_init: load no tokenizer: prompts and outputs are token ids (the outputs' text is empty).
        tokenizer: a local HF tokenizer directory to use instead of the model's own (vLLM's flag: for a GGUF
            file, vLLM's advice is its base model's tokenizer; or a checkpoint shipped without tokenizer files);
            its vocabulary must fit the model's, and its chat template is the one used.
        tokenizer_mode: vLLM's; "auto" (or "hf"): the checkpoint's fast tokenizer, the only kind loaded here.
        load_format: vLLM's; "auto" reads a .gguf file or a directory's safetensors; "gguf" or "safetensors"
            insist on that kind (a model of the other kind is refused).
        hf_overrides: vLLM's; config.json keys to replace, e.g. {"max_position_embeddings": 4096} (a JSON object on
            the command line), for a checkpoint directory (a GGUF file's configuration is its metadata).
        trust_remote_code: let transformers run the Python files of a checkpoint's tokenizer and config (their
            auto_map), as vLLM's flag does. The model itself is always this engine's own code.
        async_scheduling: plan each step while the device runs the one before (vLLM's flag), on one host,
            without speculative decoding; what needs a step's tokens first steps in lockstep (async_scheduling.py).
        task: "generate" (text) or "embed" (one vector per prompt: LLM.embed, /v1/embeddings; jax_engine/pooler.py).
        pooler_config: how task "embed" pools, a PoolerConfig or its dict (a JSON object on the command line),
            e.g. {"pooling_type": "MEAN", "normalize": true}; None: the last token's hidden state, normalized.
    """

    model: str | None = None
    dtype: str = "auto"
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_logprobs: int = MAX_LOGPROBS
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    swap_space: float = 4.0
    attention_backend: str = "auto"
    attention_self_test: str = "auto"
    seed: int = 0
    quantization: str | None = None
    enforce_eager: bool = False
    compilation_cache_dir: str = "auto"
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    speculative_config: dict | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None
    download_dir: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_mode: str = "auto"
    load_format: str = "auto"
    hf_overrides: dict | None = None
    trust_remote_code: bool = False
    async_scheduling: bool = False
    task: str = "generate"
    pooler_config: dict | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

        check(self.dtype == "auto" or self.dtype in DTYPES, "dtype", f"'auto' or one of {list(DTYPES)}")
        check(self.block_size is None or (isinstance(self.block_size, int) and self.block_size in BLOCK_SIZES),
              "block_size", "a power of two in [1, 128]")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1")
        check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        check(isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= MAX_LOGPROBS, "max_logprobs",
              f"in [0, {MAX_LOGPROBS}]: the compiled sampler keeps the top {MAX_LOGPROBS} log-probabilities")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "> 0")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"one of {list(KV_CACHE_DTYPES)}")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1, "num_gpu_blocks_override", ">= 1")
        check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", f"one of {PREEMPTION_MODES}")
        check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", f"one of {SCHEDULING_POLICIES}")
        check(self.swap_space >= 0, "swap_space", ">= 0 (GiB)")
        check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"one of {ATTENTION_BACKENDS}")
        check(self.attention_self_test in ATTENTION_SELF_TESTS, "attention_self_test",
              f"one of {ATTENTION_SELF_TESTS}")
        check(isinstance(self.seed, int), "seed", "an int")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1, "tensor_parallel_size",
              ">= 1")
        check(isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1, "data_parallel_size", ">= 1")
        check(isinstance(self.nnodes, int) and self.nnodes >= 1, "nnodes", ">= 1")
        check(isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes, "node_rank", "in [0, nnodes)")
        check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
              f"None or one of {list(QUANTIZATIONS)}")
        check(self.tokenizer_mode in TOKENIZER_MODES, "tokenizer_mode", f"one of {TOKENIZER_MODES} (a fast tokenizer)")
        check(self.load_format in LOAD_FORMATS, "load_format", f"one of {LOAD_FORMATS}")
        check(self.hf_overrides is None or isinstance(self.hf_overrides, dict), "hf_overrides", "None or a dict")
        check(not (self.tokenizer and self.skip_tokenizer_init), "tokenizer",
              "None with skip_tokenizer_init=True, which loads no tokenizer")
        check(isinstance(self.max_loras, int) and self.max_loras >= 1, "max_loras", ">= 1")
        check(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512, "max_lora_rank", "in [1, 512]")
        check(self.max_cpu_loras is None or (isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras),
              "max_cpu_loras", f"None or >= max_loras ({self.max_loras})")
        check_generation_overrides(self.override_generation_config)
        speculative = SpeculativeConfig.from_dict(self.speculative_config)  # raises naming the bad key
        check_task_args(self.task, self.pooler_config, speculative)
        if self.enable_lora and (self.nnodes > 1 or (speculative is not None and speculative.method == "draft_model")):
            raise ValueError("enable_lora is not supported yet with nnodes > 1 or a draft model (speculative_config): "
                             "LoRA adapters are served on one host, without a draft model")
        check(not (self.async_scheduling and (self.nnodes > 1 or speculative or self.task != "generate")),
              "async_scheduling", "False with nnodes > 1, a speculative_config or task 'embed'")
        drafting = speculative is not None and speculative.method == "draft_model"
        check(not (drafting and self.nnodes > 1), "nnodes", "1 with a draft model (speculative_config)")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                     **defaults) -> argparse.ArgumentParser:
        """One flag per field, named as vLLM names them (--max-model-len, ...), with its help from the docstring.

        The one place engine flags are declared: serve, generate, chat and the benchmarks all call it. A command
        leaves out (`exclude`) the fields its experiment fixes, and may change a default (`**defaults`).
        """
        unknown = (set(exclude) | defaults.keys()) - cls.field_names()
        if unknown:
            raise ValueError(f"not EngineArgs fields: {sorted(unknown)}")
        # No argparse `choices`: __post_init__ checks every value, with the same message as LLM(...) gives.
        hints, helps = typing.get_type_hints(cls), _args_section(cls.__doc__)
        for field in dataclasses.fields(cls):
            if field.name in exclude:
                continue
            flag, default = "--" + field.name.replace("_", "-"), defaults.get(field.name, field.default)
            kind = hints[field.name]
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                    help=helps[field.name])
            else:
                base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
                base = json.loads if base is dict else base  # a dictionary comes as a JSON object
                parser.add_argument(flag, type=base, default=default, help=helps[field.name] + " (default: %(default)s)")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **fixed) -> "EngineArgs":
        """The EngineArgs a parsed command line asks for; `fixed` sets the fields the command left out or owns."""
        given = {name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)}
        return cls(**{**given, **fixed})


def _args_section(doc: str) -> dict[str, str]:
    """{name: its text} from a docstring's Google-style "Args:" section (continuation lines joined)."""
    helps: dict[str, str] = {}
    for line in doc.split("Args:", 1)[1].splitlines():
        item = re.match(r"\s{8}(\w+): (.*)", line)
        if item:
            name, text = item.groups()
            helps[name] = text
        elif line.strip() and helps:
            helps[name] += " " + line.strip()
    return {name: text.replace("%", "%%") for name, text in helps.items()}


def resolve_scheduler_config(args: EngineArgs, cfg: ModelConfig) -> SchedulerConfig:
    model_len = max_len_with_rope_scaling(cfg.max_position_embeddings, cfg.rope_scaling)
    max_model_len = args.max_model_len or model_len
    if max_model_len > model_len:
        scaled = "" if cfg.rope_scaling is None else f" scaled by its rope_scaling to {model_len}"
        raise ValueError(f"max_model_len must be <= the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}{scaled}), got {max_model_len}")
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = 2048 if args.enable_chunked_prefill else max(max_model_len, 2048)
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                           max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
                           preemption_mode=args.preemption_mode, policy=args.scheduling_policy)
