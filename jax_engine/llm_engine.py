"""LLMEngine: add requests, step, read outputs. The loop that LLM.generate and the server drive.

    step():                                                 (reference/engine.py's step, batched)
        scheduler.schedule()            -> which sequences run, how many tokens each, block moves
        runner.prepare / execute        -> swap and copy blocks, pad inputs to buckets, run the jitted model
        runner.sample                   -> one token per sequence whose tokens are all computed
        scheduler.update_from_output    -> computed counts, cached blocks, forks, appended tokens, stops
        output_processor                -> logprobs, text, stop strings, one RequestOutput per request

With async_scheduling the next step is scheduled and prepared before this one's tokens are read
(jax_engine/async_scheduling.py), and step() reports the step before the one it starts.
"""

import contextlib
import functools
import logging
import time
from collections.abc import Iterator

import jax

from jax_engine.async_scheduling import StepInFlight, plan_ahead, resolve, runs_ahead
from jax_engine.config import EngineArgs, resolve_scheduler_config
from jax_engine.distributed import multihost
from jax_engine import gc_heap
from jax_engine.core.scheduler import Scheduler
from jax_engine.core.scheduler_output import SchedulerOutput
from jax_engine.engine_stats import EngineStats, StepTrace, step_trace
from jax_engine.input_processor import InputProcessor, ProcessedRequest, Prompt, RequestParams, cache_salt
from jax_engine.loader import Checkpoint, load_engine_checkpoint
from jax_engine.lora.engine_methods import LoRAEngineMethods
from jax_engine.lora.request import LoRARequest
from jax_engine.loader.generation_config import default_sampling_fields, resolve_generation_config
from jax_engine.model_config import token_ids
from jax_engine.output_processor import OutputProcessor
from jax_engine.outputs import RequestMetrics, RequestOutput
from jax_engine.pooler import Pooler
from jax_engine.pooling_params import PoolingParams, check_task
from jax_engine.runner.model_runner import StepInputs
from jax_engine.sampling_params import SamplingParams
from jax_engine.sequence import Sequence
from jax_engine.sequence_group import SequenceFactory, SequenceGroup, beam_updates
from jax_engine.sample.step_sampler import StepSampler
from jax_engine.spec_decode.speculator import Speculator
from jax_engine.spec_decode.verification import with_draft_positions
from jax_engine.structured_output.grammar import GrammarCompiler, GrammarError
from jax_engine.worker import compile_or_warm_up_model, init_devices, load_model
from reference.request import RequestStatus

logger = logging.getLogger(__name__)


class LLMEngine(LoRAEngineMethods):
    """A continuous-batching engine over a paged KV cache (vLLM's LoRA methods: jax_engine/lora/engine_methods.py)."""

    def __init__(self, args: EngineArgs, checkpoint: Checkpoint | None = None, *, devices: list | None = None,
                 detokenize: bool = True, background_loads: bool = False) -> None:
        """Load the model (or take an already loaded `checkpoint`), size the KV cache, build the loop.

        `devices`: the devices to run on, the mesh taking the first tensor_parallel_size of them (default:
        jax.devices()); a data-parallel replica gets its own (jax_engine/server/data_parallel.py).
        `detokenize=False` (an engine core's): no tokenizer loaded, no text made, no stop string checked: its API
        server does all three (engine_core/text_processor.py) and sends the grammars' tokenizer (use_tokenizer_json).
        `background_loads`: stored device programs load after this returns, on a thread (a server's: compile_shapes.py).
        """
        if args.data_parallel_size > 1 and devices is None:
            raise ValueError(f"data_parallel_size > 1 (got {args.data_parallel_size}) is served by `jax-engine serve` "
                             "(DataParallelEngine); LLM and LLMEngine run one replica: leave data_parallel_size at 1")
        # With tensor_parallel_size 1 the model uses no mesh, and its weights, KV cache and step inputs go to JAX's
        # default device: an engine given its devices makes that its first one (thread-local) to build and step.
        first = None if devices is None else devices[0]
        self._on_devices = contextlib.nullcontext if first is None else functools.partial(jax.default_device, first)
        with self._on_devices(), gc_heap.paused():  # start-up's objects all live on: see gc_heap.py
            self._build(args, checkpoint, devices, detokenize, background_loads)

    def _build(self, args: EngineArgs, checkpoint: Checkpoint | None, devices: list | None, detokenize: bool,
               background_loads: bool) -> None:
        started = time.perf_counter()
        self.pooler, args = Pooler.for_engine(args)  # task="embed": vectors instead of tokens (pooler.py)
        self.args = args
        mesh = init_devices(args, devices)  # checked before anything loads
        checkpoint = checkpoint or load_engine_checkpoint(args, tokenizer=detokenize)
        self.model_config = cfg = checkpoint.config
        self.tokenizer = None if args.skip_tokenizer_init else checkpoint.tokenizer
        self.scheduler_config = resolve_scheduler_config(args, cfg)
        loaded = load_model(args, checkpoint, mesh, self.scheduler_config)
        self.runner, self.attention_backend, self.dtype = loaded.runner, loaded.attention_backend, loaded.dtype
        self.scheduler = Scheduler(self.scheduler_config, loaded.cache_config, args.max_loras if args.enable_lora else 0)
        generation_config = resolve_generation_config(args.generation_config, checkpoint.generation_config)
        self.default_sampling_fields = default_sampling_fields(args, generation_config)
        self.eos_token_ids = tuple(dict.fromkeys(checkpoint.eos_token_ids +
                                                 token_ids(generation_config.get("eos_token_id"))))
        self.grammar_compiler = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.input_processor = InputProcessor(self.tokenizer, cfg, self.scheduler_config, self.grammar_compiler,
                                              args.max_logprobs, tokenized_elsewhere=not detokenize)
        text_tokenizer = self.tokenizer if detokenize else None
        self.output_processor = OutputProcessor(text_tokenizer, self.eos_token_ids)
        self._new_sequence = SequenceFactory(text_tokenizer, self.eos_token_ids, args.seed, self.grammar_compiler)
        self._groups: dict[str, SequenceGroup] = {}
        self._pending_outputs: list[RequestOutput] = []  # aborted requests, reported on the next step
        self._arrivals = 0
        self.trace: list[StepTrace] | None = None
        self._stats = EngineStats()
        self.speculator = Speculator.create(args.speculative, self.scheduler_config, loaded.draft_runner)
        self.startup_compile_seconds = compile_or_warm_up_model(args, loaded, self.scheduler_config, background_loads)
        if args.nnodes > 1 and args.node_rank == 0:
            self.runner = multihost.DriverRunner(self.runner)
        self.async_scheduling = args.async_scheduling  # jax_engine/async_scheduling.py
        self._in_flight: StepInFlight | None = None
        self._step_sampler = StepSampler(self.runner, self.grammar_compiler, cfg.vocab_size)
        logger.info("engine ready in %.1f s (attention backend %r%s)", time.perf_counter() - started,
                    self.attention_backend.name, ", async scheduling" if self.async_scheduling else "")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def run_worker(self) -> None:
        """On a host of node_rank > 0: make the driver's device calls until it shuts down (`serve --headless`)."""
        if self.args.node_rank == 0:
            raise ValueError("run_worker is for node_rank > 0; node_rank 0 runs the engine")
        multihost.run_worker(self.runner)

    def shutdown(self) -> None:
        """Release the other hosts' workers (also done at exit); a single-host engine has nothing to release."""
        if isinstance(self.runner, multihost.DriverRunner):
            self.runner.shutdown()

    # ------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Prompt, params: RequestParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """Validate and queue a request. Raises ValueError naming the bad field and its limit.

        With SamplingParams(n=k) the prompt is computed once and forked into k sequences; with BeamSearchParams the
        request runs beam search (jax_engine/beam_search.py). With a LoRARequest it runs with that adapter, read and
        checked here (the engine must have enable_lora). An engine started with task="embed" takes PoolingParams (the
        default there) and reports the prompt's vector. `priority`: lowest first, with scheduling_policy="priority".
        """
        params = params or (PoolingParams() if self.pooler else self.get_default_sampling_params())
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids, params = self.validate_request(prompt, params)  # params: the engine's copy
        if lora_request is not None:
            self.add_lora(lora_request)
        room = self.scheduler_config.max_model_len - len(token_ids)
        pooling = isinstance(params, PoolingParams)  # its sequence computes the prompt and then stops
        group = SequenceGroup.create(request_id, text, token_ids, SamplingParams(max_tokens=1) if pooling else params,
                                     self._arrivals, room, RequestMetrics(arrival_time or time.time()),
                                     self._new_sequence, lora_request, priority)
        self.scheduler.add_request(group.seqs, cache_salt(prompt))  # checks the priority against the policy
        if pooling:
            self.pooler.add(group.seqs[0].seq_id, params)
        self._groups[request_id] = group
        self._arrivals += 1

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: vLLM's defaults, or the generation config's (see
        EngineArgs.generation_config)."""
        return SamplingParams(**self.default_sampling_fields)

    def validate_request(self, prompt: Prompt, params: RequestParams) -> ProcessedRequest:
        """Tokenize and check a request without queuing it (see InputProcessor); safe while a step runs."""
        check_task(self.pooler is not None, params)
        return self.input_processor.process(prompt, params)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are and free their blocks; unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self._groups.pop(rid, None)
            if group is not None:
                self._finish_group(group, RequestStatus.FINISHED_ABORTED)
                self._pending_outputs.append(self.output_processor.request_output(group) if self.pooler is None
                                             else self.pooler.output(group, None))

    def stop_sequences(self, stops: list[tuple[str, int, str]]) -> None:
        """Finish the sequences whose text an engine core's API server found a stop string in: (request id, index,
        the stop string) each; the ones already finished or unknown are passed over."""
        for request_id, index, stop in stops:
            group = self._groups.get(request_id)
            if group is not None and not (seq := group.seqs[index]).status.is_finished:
                seq.stop_reason = stop
                self.scheduler.finish_requests([seq.seq_id], RequestStatus.FINISHED_STOPPED)
                if group.finished:  # reported at the next step, as an abort is
                    self._pending_outputs.append(self.output_processor.request_output(self._groups.pop(request_id)))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs) or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing forgotten) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def enable_trace(self) -> list[StepTrace]:
        """Record every step's decisions from now on in `self.trace` (returned)."""
        self.trace = []
        return self.trace

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, update, and report every request that progressed."""
        with self._on_devices():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.async_scheduling and all(runs_ahead(group) for group in self._groups.values()):
            return outputs + self._step_ahead()
        if self._in_flight is not None:  # a request that needs lockstep came: finish the step in flight first
            step, self._in_flight = self._in_flight, None
            return outputs + self._complete(step)
        out = self._schedule()
        if not out.scheduled:
            return outputs
        inputs = self.runner.prepare(out)
        if self.pooler is not None:  # an embedding engine samples nothing: finished prompts get their vector
            self.runner.apply_block_moves(out)
            pooled = self.pooler.step(out, inputs.row_of, self.runner.execute(inputs)[1], self.scheduler)
            return outputs + [self.pooler.output(self._groups.pop(seq_id), v) for seq_id, v in pooled.items()]
        return outputs + self._complete(self._dispatch(out, inputs))

    def _step_ahead(self) -> list[RequestOutput]:
        """A step of async scheduling (jax_engine/async_scheduling.py): plan and start the next step, then report
        the one that was in flight."""
        previous, self._in_flight = self._in_flight, None
        stand_ins = [] if previous is None else plan_ahead(self.scheduler, previous)
        out = self._schedule()
        inputs = self.runner.prepare(out) if out.scheduled else None
        if previous is not None:
            appended = resolve(self.scheduler, previous, stand_ins, inputs)
        if out.scheduled:
            self._in_flight = self._dispatch(out, inputs)
        return [] if previous is None else self._report(previous.out, appended)

    def _schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        if self.trace is not None:
            self.trace.append(step_trace(self.num_steps, out, self.scheduler))
        if out.scheduled:
            self._stats.record(out, self.scheduler.block_stats())
        return out

    def _dispatch(self, out: SchedulerOutput, inputs: StepInputs) -> StepInFlight:
        """Start the step on the device: moves, the model, the sampler; nothing waits for its tokens."""
        self.runner.apply_block_moves(out)
        sampling_hidden, hidden = self.runner.execute(inputs)
        self.output_processor.score_prompts(out, inputs.row_of, hidden, self.runner.token_logprobs, self._failing_alone)
        samplers = [(row, sampler) for seq, row in zip(inputs.sampling_seqs, inputs.sampling_rows)
                    for sampler in self._groups[seq.request_id].sampling_seqs(seq)]  # n > 1: the parent's row
        pending = self._step_sampler.sample(sampling_hidden, with_draft_positions(samplers), self._failing_alone)
        return StepInFlight(out, pending)

    def _complete(self, step: StepInFlight) -> list[RequestOutput]:
        """Lockstep's end of a step: its tokens verified (speculative decoding), proposed (beams) or appended."""
        sampled = step.pending.tokens()
        sampled = sampled if self.speculator is None else self.speculator.verify(sampled)
        tokens = [(seq, token) for seq, token in sampled
                  if seq.request_id in self._groups and not self._groups[seq.request_id].propose(seq, token)]
        beams = beam_updates(self._groups, step.out, self._new_sequence, self.eos_token_ids, self._failing_alone)
        appended = self.scheduler.update_from_output(step.out, tokens, beams)
        return self._report(step.out, appended)

    def _report(self, out: SchedulerOutput, appended: list) -> list[RequestOutput]:
        """The appended tokens' text and stop strings, then one output per request the step advanced."""
        stopped = self.output_processor.process_tokens(appended, self._failing_alone, self._fail_request)
        self.scheduler.finish_requests([seq.seq_id for seq in stopped], RequestStatus.FINISHED_STOPPED)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running.items, self._groups)
        return self.output_processor.request_outputs(out, self._groups)

    def _fail_request(self, seq: Sequence) -> None:
        self._finish_group(self._groups[seq.request_id], RequestStatus.FINISHED_ERROR)

    @contextlib.contextmanager
    def _failing_alone(self, seq: Sequence) -> Iterator[None]:
        """Host work for one sequence: if it raises, its request fails alone and the step goes on.

        It finishes with finish_reason "error", its blocks freed, its traceback logged (not for a GrammarError: the
        request's doing). A fault of the step itself (scheduling, the model, the sampler's device call) raises."""
        try:
            yield
        except Exception as error:
            logger.error("request %s failed; it ends with finish_reason 'error', the others go on: %s",
                         seq.request_id, error, exc_info=not isinstance(error, GrammarError))
            self._finish_group(self._groups[seq.request_id], RequestStatus.FINISHED_ERROR)

    def _finish_group(self, group: SequenceGroup, status: RequestStatus) -> None:
        self.scheduler.finish_requests([seq.seq_id for seq in group.live_seqs], status)

    # ---------------------------------------------------------------------------- statistics
    @property
    def num_steps(self) -> int:
        return self._stats.num_steps

    def stats(self) -> dict:
        """KV-cache and scheduling statistics since the engine started (and speculative decoding's, when on)."""
        return self._stats.report(self.scheduler, self.runner, self.speculator)
