"""The model on its devices with its KV cache sized: what start-up does before the engine's first step.

vLLM's Worker in two calls: `init_devices` joins the other hosts and builds the tensor-parallel mesh (before
anything loads, so a bad device setting fails in seconds), and `load_model` places the weights, picks the
attention backend (and tests the Pallas kernels against the xla path first: runner/attention_self_test.py),
sizes the KV cache from the memory left and builds the model runner over it. The engine then hands the
cache's shape to its scheduler (CacheConfig) and compiles the runner's programs.
"""

from dataclasses import dataclass

import jax.numpy as jnp
from jax.sharding import Mesh

from jax_engine.attention import AttentionBackend, get_attention_backend
from jax_engine.runner.compile_shapes import compile_step_shapes, use_compilation_cache
from jax_engine.config import EngineArgs
from jax_engine.core.kv_cache_manager import CacheConfig
from jax_engine.distributed import multihost
from jax_engine.distributed.tensor_parallel import make_mesh
from jax_engine.kv_cache_plan import plan_kv_cache, resolve_block_size, resolve_kv_cache_dtype
from jax_engine.loader import Checkpoint
from jax_engine.lora.layout import LoRALayout
from jax_engine.runner.attention_self_test import AttentionShapes, checked_backend
from jax_engine.runner.device_programs import DRAFT_PROGRAMS, POOLING_PROGRAMS, TARGET_PROGRAMS
from jax_engine.runner.model_runner import ModelRunner
from jax_engine.models.causal_lm import CausalLM
from jax_engine.spec_decode.draft_model import load_draft_model
from jax_engine.target_platform import platform
from reference.scheduler import SchedulerConfig


@dataclass
class LoadedModel:
    runner: ModelRunner
    cache_config: CacheConfig
    attention_backend: AttentionBackend
    dtype: object  # the weights' and activations'; the cache's is runner.k_cache.dtype
    draft_runner: ModelRunner | None = None  # speculative decoding's draft model, over a cache of its own

    @property
    def runners(self) -> list[ModelRunner]:
        """Every runner start-up compiles programs for."""
        return [self.runner] + ([] if self.draft_runner is None else [self.draft_runner])


def resolve_dtype(name: str):
    """The weights' and activations' dtype EngineArgs.dtype names (arg_choices.DTYPES, or "auto")."""
    if name == "auto":
        return jnp.float32 if platform() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def init_devices(args: EngineArgs, devices: list | None) -> Mesh | None:
    """Join the other hosts (multi-node), turn the compilation cache on, build the mesh (None without TP)."""
    if args.nnodes > 1:  # before anything asks JAX for its devices
        multihost.initialize(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    use_compilation_cache(args.compilation_cache_dir)
    return make_mesh(args.tensor_parallel_size, devices)


def load_model(args: EngineArgs, checkpoint: Checkpoint, mesh: Mesh | None,
               scheduler_config: SchedulerConfig) -> LoadedModel:
    """Weights on the devices (a draft model's too), the attention backend (self-tested), the KV cache sized and
    allocated, the runner over it."""
    cfg, dtype = checkpoint.config, resolve_dtype(args.dtype)
    model = CausalLM.from_hf_weights(cfg, checkpoint.weights, dtype, args.quantization, checkpoint.blocks, mesh)
    lora_bytes = 0
    if args.enable_lora:
        model.add_lora_slots(LoRALayout.of(cfg, checkpoint.weights, args.max_loras, args.max_lora_rank))
        # Counted whole on each device: under tensor parallelism the split stacks take less (the safe side).
        lora_bytes = args.max_loras * model.lora_layout.slot_bytes(dtype)
    draft = load_draft_model(args.speculative, checkpoint, dtype, mesh, scheduler_config.max_model_len)
    backend = get_attention_backend(args.attention_backend, platform())
    if cfg.sliding_window_layers is not None and backend.name == "pallas":  # its kernels take one static window
        if args.attention_backend == "pallas":
            raise ValueError("attention_backend 'pallas' takes one sliding window for every layer, and this model's "
                             "layers differ (Gemma 2, Gemma 3): use 'auto', 'xla' or 'cpu'")
        backend = get_attention_backend("xla", platform())
    # The block size the cache will have (xla, the fallback, has pallas's default too).
    block_size = resolve_block_size(args.block_size, backend)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    shapes = AttentionShapes.of(cfg, cache_dtype, block_size, scheduler_config.max_model_len)
    backend = checked_backend(args.attention_self_test, backend, shapes, platform())
    if args.nnodes > 1:  # every host serves on the driver's backend: they run one program
        backend = get_attention_backend(multihost.agree(backend.name), platform())
    block_size, num_blocks, num_host_blocks = plan_kv_cache(args, cfg, dtype, backend, scheduler_config.max_model_len,
                                                            model.cache_heads_per_device, draft, lora_bytes)
    if args.nnodes > 1:  # every host's cache must have the driver's block count (free memory may differ)
        num_blocks, num_host_blocks = multihost.agree((num_blocks, num_host_blocks))
    runner = ModelRunner(model, num_blocks, block_size, num_host_blocks, scheduler_config.max_model_len,
                         scheduler_config.max_num_seqs, backend, cache_dtype, max_sampled_rows(args, scheduler_config),
                         max_cpu_loras=args.max_cpu_loras or args.max_loras,
                         device_programs=POOLING_PROGRAMS if args.task == "embed" else TARGET_PROGRAMS)
    draft_runner = None if draft is None else ModelRunner(
        draft, num_blocks, block_size, 0, scheduler_config.max_model_len, scheduler_config.max_num_seqs, backend,
        cache_dtype, device_programs=DRAFT_PROGRAMS)
    cache_config = CacheConfig(num_blocks, block_size, num_host_blocks, args.enable_prefix_caching)
    return LoadedModel(runner, cache_config, backend, dtype, draft_runner)


def compile_or_warm_up_model(args: EngineArgs, loaded: LoadedModel, scheduler_config: SchedulerConfig,
                             background: bool = False) -> float:
    """Every runner's start-up programs loaded or compiled (vLLM's name; jax_engine/runner/compile_shapes.py);
    returns the seconds it took. `background`: stored programs load on a thread, after this returns."""
    if args.enforce_eager:
        return 0.0
    return sum(compile_step_shapes(runner, scheduler_config.max_num_batched_tokens, args.compilation_cache_dir,
                                   swap=scheduler_config.preemption_mode == "swap", background=background)
               for runner in loaded.runners)


def max_sampled_rows(args: EngineArgs, config: SchedulerConfig) -> int:
    """The most logits rows one step samples: a row per sequence, plus one per draft while speculation is on
    (below disable_by_batch_size sequences), never more than the step's tokens."""
    spec = args.speculative
    if spec is None:
        return config.max_num_seqs
    speculating = min(config.max_num_seqs, (spec.disable_by_batch_size or config.max_num_seqs + 1) - 1)
    return max(config.max_num_seqs, min(speculating * (1 + spec.num_speculative_tokens), config.max_num_batched_tokens))
