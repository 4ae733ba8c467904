"""The model runner: turns a SchedulerOutput into padded device arrays and runs the jitted step.

Every shape is rounded up to a bucket (powers of two, the rows sampled among them; quarters of a power of two
for the token count past 16; 1.5 x powers of two for the context length on the padded layout), so the number of
compilations stays small and a steady state (same buckets) never recompiles. On the ragged layout every
shape of the model step follows from the token bucket alone, so start-up can compile them all
(jax_engine/runner/compile_shapes.py) into `programs`, which the runner calls instead of the jitted functions (each
declared once, in jax_engine/runner/device_programs.py).
The KV cache is donated to each step and updated in place.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_engine.attention.metadata import AttentionBackend, AttentionMetadata
from jax_engine.buckets import bucket, bucket_fine, bucket_tokens
from jax_engine.core.scheduler_output import SchedulerOutput
from jax_engine.runner.device_programs import (ALL_LOGITS, COPIED, COPY, DEVICE_CALLS, GREEDY, LOGITS, ROWS, SAMPLE,
                                               SCORED_ROWS, STEP, SWAP_IN, SWAP_OUT, SWAPPED, TARGET_PROGRAMS,
                                               TOKEN_LOGPROBS, TOKENS, DeviceProgram, block_move_bucket)
from jax_engine.lora.manager import LoRAManager
from jax_engine.models.causal_lm import CausalLM
from jax_engine.runner.flat_model import FlatModel, FlattenedModel
from jax_engine.runner.padded_layout import padded_kind_rows, padded_table_rows
from jax_engine.runner.program_cache import ProgramCache
from jax_engine.runner.recycled_buffers import RecycledBuffers
from jax_engine.sample.sampler import SampledRows, to_host
from jax_engine.sample.sampling_batch import STAGES, SamplingBatch, sampling_batch
from reference.block_manager import cdiv


def _padded(indices: list[int], count: int, fill: int) -> np.ndarray:
    """indices as int32, padded with `fill` to `count` entries."""
    return np.pad(np.asarray(indices, np.int32), (0, count - len(indices)), constant_values=fill)


@dataclass
class StepInputs:
    """Host-side arrays of one step, before transfer."""

    token_ids: np.ndarray
    lora_slots: np.ndarray  # [T] each token's LoRA adapter slot; -1 for none (and for padding)
    metadata: AttentionMetadata
    logits_indices: np.ndarray  # [max_sampled_rows or more] rows whose next-token logits are sampled (padded)
    sampling_seqs: list  # the Sequences that sample this step, in order
    sampling_rows: list[int]  # the first entry of logits_indices of each: its drafts' rows follow it
    row_of: dict[str, int]  # first row of each scheduled sequence's tokens


class ModelRunner:
    """Owns the model weights and the device KV cache; executes one scheduled step at a time."""

    DEVICE_CALLS = DEVICE_CALLS  # its methods that run device programs (multi-host wiring repeats them)

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, num_host_blocks: int,
                 max_model_len: int, max_num_seqs: int, backend: AttentionBackend, dtype,
                 max_sampled_rows: int | None = None, device_programs: tuple = TARGET_PROGRAMS,
                 max_cpu_loras: int = 0) -> None:
        self.model = model
        self.device_programs = device_programs  # what start-up compiles for it (DRAFT_PROGRAMS: a draft model's)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # Rows of logits sampled in one step: one per sequence, and one more per draft with speculative decoding.
        self.max_sampled_rows = max_sampled_rows or max_num_seqs
        self.max_model_len = max_model_len
        self.num_slots = num_blocks * block_size
        self.backend = backend
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        # Under tensor parallelism the cache is split on KV heads and the step's inputs are replicated.
        self.replicated = None if model.parallel is None else NamedSharding(model.parallel.mesh, P())
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.k_cache = jnp.zeros(shape, dtype, device=model.kv_cache_sharding())
        self.v_cache = jnp.zeros(shape, dtype, device=model.kv_cache_sharding())
        # The host pool for swapped-out blocks lives in NumPy (CPU RAM) memory.
        host_shape = model.kv_cache_shape(num_host_blocks, block_size)
        self.host_k = np.zeros(host_shape, np.dtype(dtype))
        self.host_v = np.zeros(host_shape, np.dtype(dtype))
        # Every device call's program, by its key (device_programs.py): start-up's (compile_shapes.py), or one
        # compiled on first use for a shape start-up did not list (at most MAX_LATE_PROGRAMS kept).
        self.programs = ProgramCache()
        self.recycled = RecycledBuffers(self.replicated)
        self.lora = None if model.lora_layout is None else LoRAManager(model, max_cpu_loras)
        self._flattened = FlattenedModel(model)

    @property
    def flat_model(self) -> FlatModel:  # the model as every program takes it (flat_model.py)
        return self._flattened.at(self.lora.writes if self.lora else 0)

    # ------------------------------------------------------------------------- block copies
    def apply_block_moves(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write, before the step that relies on them.

        Each move is padded to a bucket of blocks and runs a program start-up compiled (when swapping is on):
        swap sizes vary with every preemption, and a swap-in written by an eager scatter also copied the
        whole cache, since only a jitted function can donate it."""
        if out.swap_out:
            src, dst = map(list, zip(*out.swap_out.items()))
            count = self._ready_size(SWAPPED, block_move_bucket(len(src)))
            src_padded = _padded(src, count, 0)  # padding reads block 0 again
            for cache, host in ((self.k_cache, self.host_k), (self.v_cache, self.host_v)):
                moved = self._run(SWAP_OUT, (cache, src_padded))
                for shard in moved.addressable_shards:  # each device's heads (all of them on one device)
                    layers, _, slots, heads, dims = shard.index
                    host[layers, dst, slots, heads, dims] = np.asarray(shard.data)[:, : len(dst)]
        if out.swap_in:
            src, dst = map(list, zip(*out.swap_in.items()))
            count = self._ready_size(SWAPPED, block_move_bucket(len(src)))
            src = _padded(src, count, src[0])  # padding reads a host block again; its write is dropped
            dst_padded = _padded(dst, count, self.k_cache.shape[1])
            self.k_cache, self.v_cache = (
                self._swap_in(cache, jax.make_array_from_callback(
                    (cache.shape[0], count, *cache.shape[2:]), cache.sharding,
                    lambda index, host=host: host[index[0], src, *index[2:]]), dst_padded)
                for cache, host in ((self.k_cache, self.host_k), (self.v_cache, self.host_v)))
        if out.copies:  # padded to a bucket so that copy counts do not each compile
            src, dst = zip(*out.copies)
            count = self._ready_size(COPIED, block_move_bucket(len(src)))
            src, dst = _padded(src, count, 0), _padded(dst, count, self.k_cache.shape[1])  # padding writes are dropped
            self.k_cache, self.v_cache = self._run(COPY, (self.k_cache, self.v_cache, src, dst))

    def _swap_in(self, cache: jax.Array, blocks: jax.Array, dst: np.ndarray) -> jax.Array:
        return self._run(SWAP_IN, (cache, blocks, dst))

    def _run(self, program: DeviceProgram, args: tuple, kwargs: dict | None = None, cause: str = ""):
        """Run `program` on `args`: start-up's compiled program for their shapes, or one compiled now (see
        ProgramCache.call; `cause` says what made the shape)."""
        return self.programs.call(program.key(args, kwargs), program.fn, args, kwargs, program.static(self), cause)

    def _ready_size(self, dimension: str, size: int) -> int:
        """`size`, or a larger one while start-up still compiles its programs (staged_sizes.py)."""
        return self.programs.sizes.padded(dimension, size)

    def placed(self, host_args):
        """Host arguments as start-up compiles a program for them: on the default device, or replicated over the
        model's mesh (the program then places NumPy arguments itself)."""
        if self.replicated is None:
            return host_args
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.result_type(x), sharding=self.replicated),
                            host_args)

    # ------------------------------------------------------------------------------- inputs
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Lay out the step's tokens: decode sequences first, then prefill chunks, all padded."""
        bs = self.block_size
        decode = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefill = [s for s in out.scheduled if s.num_new_tokens > 1]
        # Tokens are bucketed on their own, finely (in quarters of a power of two): every padding token runs
        # through every layer, and a full decode batch plus one short prompt (257 tokens) would run as 384
        # in steps of 1.5x (320 here). The logits rows follow from the sequence buckets, one less
        # independent size to compile combinations of.
        padded_tokens = self._ready_size(TOKENS, bucket_tokens(sum(s.num_new_tokens for s in out.scheduled)))
        # Rows for sequences: max_num_seqs, the shape start-up compiles. The scheduler admits a sequence with
        # the forks it will make, so only a beam search that narrowed and widens again can pass it (such a
        # step compiles its own shape on first use).
        capacity = max(self.max_num_seqs, bucket_tokens(len(out.scheduled)))
        seq_slots, num_rows, num_cols = self._sequence_layout(decode, prefill, min(padded_tokens, capacity))

        token_ids = np.zeros(padded_tokens, np.int32)
        positions = np.zeros(padded_tokens, np.int32)
        slot_mapping = np.full(padded_tokens, self.num_slots, np.int32)  # padding: out of range, dropped
        tables = np.zeros((num_rows, num_cols), np.int32)
        seq_lens = np.zeros(num_rows, np.int32)
        q_lens = np.zeros(num_rows, np.int32)
        logits_rows, sampling_seqs, sampling_rows, row_of = [], [], [], {}

        row = 0
        for slot, s in zip(seq_slots, decode + prefill):
            seq, n = s.seq, s.num_new_tokens
            first = seq.num_computed_tokens
            pos = np.arange(first, first + n)
            token_ids[row : row + n] = seq.tokens_to_compute(n)
            positions[row : row + n] = pos
            slot_mapping[row : row + n] = np.asarray(s.block_table)[pos // bs] * bs + pos % bs
            used = cdiv(first + n, bs)  # the table may run further (blocks for later chunks)
            tables[slot, :used] = s.block_table[:used]
            seq_lens[slot] = first + n
            q_lens[slot] = n
            row_of[seq.seq_id] = row
            if first + n >= seq.num_tokens:  # all its tokens computed: sample the next one (and verify drafts)
                sampling_rows.append(len(logits_rows))
                logits_rows += range(row + n - 1 - len(seq.spec_token_ids), row + n)
                sampling_seqs.append(seq)
            row += n
        decode_rows, prefill_rows = self._kind_rows(decode, prefill, row_of, padded_tokens)
        logits_indices = np.zeros(max(self.max_sampled_rows, capacity), np.int32)
        logits_indices[: len(logits_rows)] = logits_rows
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)  # rows are laid out in this order
        metadata = AttentionMetadata(positions, slot_mapping, tables, seq_lens, starts, decode_rows, prefill_rows,
                                     0 if self.backend.ragged else max(prefill_rows.shape[1], 1))  # max_query_len
        return StepInputs(token_ids, self._lora_slots(out, row_of, padded_tokens), metadata, logits_indices,
                          sampling_seqs, sampling_rows, row_of)

    def _lora_slots(self, out: SchedulerOutput, row_of: dict[str, int], padded_tokens: int) -> np.ndarray:
        """Each token's LoRA slot (-1: none), the step's adapters put in slots first (jax_engine/lora/manager.py)."""
        slots = np.full(padded_tokens, -1, np.int32)
        if self.lora is None:  # a draft model's runner too: its sequences (DraftView) carry no adapter
            return slots
        with_adapter = [s for s in out.scheduled if s.seq.lora_request is not None]
        slot_of = self.lora.activate({s.seq.lora_request for s in with_adapter})
        for s in with_adapter:
            row = row_of[s.seq.seq_id]
            slots[row : row + s.num_new_tokens] = slot_of[s.seq.lora_request.lora_int_id]
        return slots

    def _sequence_layout(self, decode: list, prefill: list, ragged_rows: int) -> tuple[list[int], int, int]:
        """(table row of each scheduled sequence, decode then prefill; rows; table columns), bucketed."""
        if self.backend.ragged:
            # The backend finds each token's sequence through query_start_loc and reads a table only up to
            # the token's position: no padding between the kinds, and one table width and one row count per
            # token bucket (padding rows and columns cost a few bytes to copy, a distinct shape a compile).
            count = len(decode) + len(prefill)
            return list(range(count)), ragged_rows, self.max_blocks_per_seq
        seq_slots, num_rows = padded_table_rows(len(decode), len(prefill))
        max_blocks = max(cdiv(s.seq.num_computed_tokens + s.num_new_tokens, self.block_size)
                         for s in decode + prefill)
        return seq_slots, num_rows, min(bucket_fine(max_blocks, 8), self.max_blocks_per_seq)

    def _kind_rows(self, decode: list, prefill: list, row_of: dict[str, int],
                   padded_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """padded_kind_rows of the step; empty for a ragged backend, which does not read them (and so compiles
        no shape per chunk length)."""
        if self.backend.ragged:
            return np.zeros(0, np.int32), np.zeros((0, 0), np.int32)
        return padded_kind_rows([row_of[s.seq.seq_id] for s in decode],
                                [(row_of[s.seq.seq_id], s.num_new_tokens) for s in prefill], padded_tokens)

    # -------------------------------------------------------------------------------- execute
    def execute(self, inputs: StepInputs) -> tuple[jax.Array, jax.Array]:
        """Run the step. Returns (hidden states of the sampling rows [max_sampled_rows, H], all of them [T, H])."""
        host_inputs = (inputs.token_ids, inputs.lora_slots, inputs.metadata, inputs.logits_indices)
        key = STEP.key((self.flat_model, self.k_cache, self.v_cache, *host_inputs))
        if key not in self.programs and self.replicated is not None:  # through jit: place them first
            host_inputs = jax.device_put(host_inputs, self.replicated)
        # A compiled program places NumPy inputs itself, by its input shardings: the call took 0.2 ms at batch 1,
        # where jax.device_put first and then the call took 0.5 (of a ~8 ms int8 token on 2 cores).
        sampling_hidden, hidden, self.k_cache, self.v_cache = self._run(
            STEP, (self.flat_model, self.k_cache, self.v_cache, *host_inputs),
            cause=f"a step of {key[1][0]} tokens, {key[2][0]} sequences, {key[2][1]} blocks")
        return sampling_hidden, hidden

    def sampling_batch(self, seqs: list, grammar_bitmask: np.ndarray | None = None) -> SamplingBatch:
        """The sampler's arrays for `seqs`, one row each, padded to the row bucket `sample` uses."""
        return sampling_batch(seqs, self._ready_size(ROWS, bucket(len(seqs))), self.model.cfg.vocab_size,
                              grammar_bitmask, penalty_width=self.max_model_len)

    def sample(self, sampling_hidden: jax.Array, rows: list[int], batch: SamplingBatch) -> SampledRows:
        """A token for each of `rows` of `sampling_hidden` (parallel samples share their parent's row), drawn
        with the matching row of `batch` (see sampling_batch); dispatched, not waited for. The logits and the
        sampler's scratch live in recycled buffers."""
        if not rows:
            return SampledRows(None, 0)
        padded = np.zeros(len(batch.seeds), np.int32)  # the batch's rows, as many as the logits
        padded[: len(rows)] = rows
        buffer = self.recycled.take((len(padded), self.model.cfg.vocab_size))
        logits = self._run(LOGITS, (self.flat_model, sampling_hidden, padded, np.int32(len(rows)), buffer),
                           cause=f"{len(rows)} rows sampled")
        scratch = self.recycled.take(logits.shape)
        stages = [s for s, on in zip(STAGES, batch.stages) if on] if batch.flags.general else []
        result, scratch = self._run(SAMPLE, (logits, batch), {"scratch": scratch},
                                    cause=f"{len(rows)} rows sampled with {batch.flags} {stages}")
        self.recycled.give(scratch)
        self.recycled.give(logits)
        return SampledRows(result, len(rows))

    def greedy_tokens(self, sampling_hidden: jax.Array, num_rows: int) -> list[int]:
        """The most likely next token after each of the first `num_rows` rows of `sampling_hidden` (a draft
        model's proposals: the rows of a step whose sequences each sample one token)."""
        rows = np.arange(self._ready_size(ROWS, bucket(num_rows)), dtype=np.int32)
        tokens = self._run(GREEDY, (self.flat_model, sampling_hidden, rows), cause=f"{num_rows} drafts")
        return to_host(tokens)[:num_rows].tolist()

    def all_logits(self, hidden: jax.Array) -> np.ndarray:
        """Logits of every row of a step's hidden states (tests compare them with other models')."""
        return to_host(self._run(ALL_LOGITS, (self.flat_model, hidden)))

    def token_logprobs(self, hidden: jax.Array, rows: list[int], targets: list[int]):
        """(logprob, rank, top MAX_LOGPROBS ids, their logprobs) of each target token after its row of a step's
        hidden states, as NumPy arrays.

        The rows are gathered on the host and scored SCORED_ROWS at a time by one program, whatever the step's
        token count or the number of positions (a program per pair of them would compile mid-stream)."""
        chosen = to_host(hidden)[rows]  # [N, H]
        results = []
        for start in range(0, len(rows), SCORED_ROWS):
            chunk = np.zeros((SCORED_ROWS, chosen.shape[1]), chosen.dtype)
            part = chosen[start : start + SCORED_ROWS]
            chunk[: len(part)] = part
            chunk_targets = _padded(targets[start : start + SCORED_ROWS], SCORED_ROWS, 0)
            scores = self._run(TOKEN_LOGPROBS, (self.flat_model, chunk, chunk_targets), cause="prompt logprobs")
            results.append([to_host(x) for x in scores])
        return tuple(np.concatenate(column)[: len(rows)] for column in zip(*results))

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling programs after start-up."""
        return self.programs.late_compile_seconds
