"""EngineCoreClient: the engine as the API server process sees it when the engine runs in a process of its own.

It offers what AsyncLLMEngine and the server use of an LLMEngine (add_request, abort_request, the waiting and
running counts, stats, request checks and the tokenizer), and, in place of step(), `next_outputs`: the next
outputs the engine core process sent (core.py). The tokenizer is loaded here, as in vLLM v1, while the core loads
the weights without it (and without importing transformers); the core gets it as JSON for its grammars. Requests
are checked and tokenized here, and outputs get their text and stop strings (text_processor.py), on it and the
configs the core sent once ready (messages.EngineFacts); the core only schedules, steps and samples.

A client starts its own core process and stops it, or, with `--api-server-count N`, binds the sockets of a core
that jax_engine/server/api_servers.py started for N API servers, and only tells it that it leaves.
"""

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import types

import zmq
import zmq.asyncio

from jax_engine.config import EngineArgs
from jax_engine.engine_core.launch import StartedCore, start_engine_core
from jax_engine.engine_core.messages import AddRequest, CoreOutputs, EngineFacts, decode, encode, params_for_core
from jax_engine.engine_core.output_deltas import DeltaDecoder
from jax_engine.engine_core.text_processor import TextProcessor
from jax_engine.input_processor import InputProcessor, ProcessedRequest, Prompt, RequestParams
from jax_engine.loader.hf_loader import check_tokenizer_fits
from jax_engine.loader.load import load_engine_tokenizer
from jax_engine.lora.engine_methods import LORA_DISABLED
from jax_engine.lora.request import LoRARequest
from jax_engine.outputs import CompletionOutput, RequestOutput
from jax_engine.pooling_params import check_task
from jax_engine.sampling_params import SamplingParams
from jax_engine.structured_output.grammar import GrammarCompiler, tokenizer_json

logger = logging.getLogger(__name__)
LIVENESS_CHECK_S = 1.0  # how often a client waiting on the core checks that its process is alive
STOP_WAIT_S = 10.0  # how long shutdown() waits for the core to exit before it kills it
SHARED_CORE_LINGER_MS = 2000  # how long a client of a shared core tries to deliver its "shutdown"


class EngineCoreDiedError(RuntimeError):
    """The engine core process failed or exited; the text says how (its traceback, when it could send one)."""


class EngineCoreClient:
    """An engine in another process, behind LLMEngine's face (see the module docstring).

    Starting it starts the engine core process (or, given `shared_core`'s (input, output) socket addresses, takes
    the place of one of the API servers a supervisor started the core for) and waits until its engine is ready
    (the model loaded, its shapes compiled); an error there raises EngineCoreDiedError with the core's traceback.
    `replica`: the data-parallel replica the core runs (server/data_parallel.py), on that replica's devices.
    """

    def __init__(self, args: EngineArgs, log_level: str = "INFO", shared_core: tuple[str, str] | None = None,
                 replica: int | None = None, started: StartedCore | None = None) -> None:
        self.args = args
        if shared_core:
            self._process, self._dir, (inputs, outputs) = _Supervisor(), None, shared_core
        else:  # `started` by `jax-engine serve` before its imports, or now
            started = started or start_engine_core(args, log_level, replica)
            self._process, self._dir, (inputs, outputs) = started.process, started.directory, started.addresses
        self._context = zmq.Context()
        self._to_core = self._bound(zmq.PUSH, inputs)
        self._from_core = self._bound(zmq.PULL, outputs)
        atexit.register(self.shutdown)
        self._outputs = DeltaDecoder()  # unfinished requests' outputs so far
        self._text = None  # their text (a TextProcessor, once the core has sent the tokenizer)
        self._adds_sent = 0
        self._adapter_of: dict[str, int] = {}  # unfinished request id -> its LoRA adapter's id
        self._receiving: asyncio.Future | None = None
        self._async_from_core: zmq.asyncio.Socket | None = None
        try:
            self.tokenizer = load_engine_tokenizer(args)  # while the core loads the model
            as_json = None if self.tokenizer is None else tokenizer_json(self.tokenizer)
            facts = self._wait_ready()
            if as_json is not None:  # now: a send waits until the core has connected
                self._send("tokenizer", as_json)
            self._take_facts(facts, as_json)
        except BaseException:
            self.shutdown()
            raise

    def _bound(self, kind: int, address: str) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        return socket

    def _wait_ready(self) -> EngineFacts:
        while not self._from_core.poll(int(LIVENESS_CHECK_S * 1000)):
            self._check_alive()
        kind, body = decode(self._from_core.recv())
        if kind != "ready":
            raise self._died(kind, body)
        return body

    def _take_facts(self, facts: EngineFacts, as_json: str | None) -> None:
        self.model_config, self.scheduler_config = facts.model_config, facts.scheduler_config
        if self.tokenizer is not None and self.args.tokenizer:  # the model's size is known now
            check_tokenizer_fits(self.tokenizer, self.model_config.vocab_size, self.args.tokenizer)
        self.eos_token_ids = facts.eos_token_ids
        self._text = TextProcessor(self.tokenizer)
        self.default_sampling_fields = facts.default_sampling_fields
        self.startup_compile_seconds = facts.startup_compile_seconds
        self._state = CoreOutputs([], 0, 0, 0, facts.stats)
        self.speculator = _CoreSpeculator(self) if facts.speculative else None
        self.runner = types.SimpleNamespace(lora=facts.lora_checker)  # what the server asks of runner.lora: check
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                                builds_matchers=False)  # the core builds them (grammar_builds.py)
        if as_json is not None:
            self.grammar_compiler.use_tokenizer_json(as_json)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config, self.scheduler_config,
                                              self.grammar_compiler, self.args.max_logprobs)

    # ------------------------------------------------------------------- LLMEngine's face
    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.default_sampling_fields)

    def validate_request(self, prompt: Prompt, params: RequestParams) -> ProcessedRequest:
        """Tokenize and check a request here, in the API server process (LLMEngine.validate_request)."""
        check_task(self.args.task == "embed", params)
        return self.input_processor.process(prompt, params)

    def add_request(self, request_id: str, prompt: dict, params: RequestParams,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        """Send a checked request (AsyncLLMEngine's prompt dict: text, token ids, cache_salt) to the core."""
        grammar = getattr(params, "compiled_grammar", None)  # its matcher stays here; the core builds its own
        self._outputs.start(request_id, prompt.get("prompt"), prompt["prompt_token_ids"])
        self._text.start(request_id, prompt["prompt_token_ids"], params)
        if lora_request is not None:
            self._adapter_of[request_id] = lora_request.lora_int_id
        self._adds_sent += 1
        self._send("add", AddRequest(request_id, prompt, params_for_core(params), lora_request,
                                     grammar and grammar.text, priority))

    def abort_request(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send("abort", list(request_ids))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter here (ValueError if bad), and have the core load it now."""
        if self.runner.lora is None:
            raise ValueError(LORA_DISABLED)
        self.runner.lora.check(lora_request)
        self._send("add_lora", lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Have the core forget an adapter: AsyncLLMEngine asks once lora_users is empty, and the core hears of
        every abort and stop before it."""
        self._send("remove_lora", lora_id)
        return True

    def lora_users(self, lora_id: int) -> list[str]:
        return [request_id for request_id, adapter in self._adapter_of.items() if adapter == lora_id]

    def has_unfinished_requests(self) -> bool:
        return len(self._outputs) > 0

    def num_waiting_sequences(self) -> int:
        """The core's waiting sequences, and the adds sent that it has not taken yet."""
        return self._state.num_waiting + self._adds_sent - self._state.adds_applied

    def num_running_sequences(self) -> int:
        return self._state.num_running

    def stats(self) -> dict:
        """The engine's statistics as of the core's last message."""
        return self._state.stats

    # ----------------------------------------------------------------------------- outputs
    async def next_outputs(self, wakeup: asyncio.Event) -> list:
        """The outputs of the core's next message, or [] as soon as `wakeup` is set (there is new work to send).

        Raises EngineCoreDiedError if the core reports an error of its loop, or its process exits.
        """
        if self._receiving is None:
            if self._async_from_core is None:  # on the loop that drives the engine, from its first use
                self._async_from_core = zmq.asyncio.Socket.from_socket(self._from_core)
            self._receiving = asyncio.ensure_future(self._async_from_core.recv())
        woken = asyncio.ensure_future(wakeup.wait())
        try:
            while not (self._receiving.done() or woken.done()):
                await asyncio.wait({self._receiving, woken}, timeout=LIVENESS_CHECK_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not self._receiving.done():
                    self._check_alive()
        finally:
            woken.cancel()
        if not self._receiving.done():
            return []
        frame, self._receiving = self._receiving.result(), None
        return self._take_message(*decode(frame))

    def _take_message(self, kind: str, body) -> list:
        if kind == "rejected":  # the core refused an add that passed the checks here: it fails alone
            request_id, error = body
            logger.error("the engine core refused request %s: %s", request_id, error)
            return [self._failed_output(request_id)]
        if kind != "outputs":
            raise self._died(kind, body)
        self._state = body
        outputs, stops = [], []
        for delta in body.outputs:
            if (output := self._outputs.decode(delta)) is not None:
                output, stopped = self._text.process(output)
                outputs.append(output)
                stops += stopped
                if output.finished:  # also when a stop string finished it here: what the core still sends of
                    self._forget(output.request_id)  # it is dropped
        if stops:
            self._send("stop", stops)
        return outputs

    def _forget(self, request_id: str) -> RequestOutput | None:
        """Forget a finished request; its output so far (None if forgotten already)."""
        self._text.forget(request_id)
        self._adapter_of.pop(request_id, None)
        return self._outputs.forget(request_id)

    def _failed_output(self, request_id: str) -> RequestOutput:
        output = self._forget(request_id)
        output.outputs, output.finished = [CompletionOutput(0, "", [], None, None, "error")], True
        return output

    # --------------------------------------------------------------------------- lifecycle
    def _send(self, kind: str, body) -> None:
        self._to_core.send(encode(kind, body))

    def _check_alive(self) -> None:
        if self._process.poll() is not None:
            if isinstance(self._process, _Supervisor):
                raise EngineCoreDiedError("the supervising `jax-engine serve` process is gone")
            raise EngineCoreDiedError(f"the engine core process exited with status {self._process.returncode}")

    def _died(self, kind: str, body) -> Exception:
        if kind == "refused":  # its flags or model could not start an engine: the error the engine itself raised
            return ValueError(body)
        if kind == "dead":
            return EngineCoreDiedError(f"the engine core process failed:\n{body}")
        return EngineCoreDiedError(f"unexpected message {kind!r} from the engine core process")

    def shutdown(self) -> None:
        """Stop the engine core process (at once: unfinished requests are dropped) and remove its sockets; a shared
        core is told that this API server leaves (it stops once all have)."""
        atexit.unregister(self.shutdown)
        shared = isinstance(self._process, _Supervisor)
        if shared or self._process.poll() is None:
            # Without a core connected (it died, or is exiting after it said why) there is nobody to tell: a
            # blocking send would wait for one forever.
            with contextlib.suppress(zmq.Again):
                self._to_core.send(encode("shutdown", None), zmq.NOBLOCK)
        if not shared and self._process.poll() is None:
            try:
                self._process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.error("the engine core did not stop within %.0f s: killing it", STOP_WAIT_S)
                self._process.kill()
                self._process.wait()
        if self._receiving is not None:
            self._receiving.cancel()
        self._context.destroy(linger=SHARED_CORE_LINGER_MS if shared else 0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        if hasattr(self, "grammar_compiler"):  # made once the core was ready
            self.grammar_compiler.close()


class _Supervisor:
    """Stands for the core process where a supervisor started it (api_servers.py): it watches the core and tells
    each API server if it dies ("dead"); here we watch the supervisor, our parent."""

    def __init__(self) -> None:
        self._parent = os.getppid()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and os.getppid() != self._parent:
            self.returncode = -1  # its status is its own parent's to read
        return self.returncode


class _CoreSpeculator:
    """What /metrics reads of a speculator: its counters, as of the core's last message."""

    def __init__(self, client: EngineCoreClient) -> None:
        self._client = client

    def stats(self) -> dict:
        return self._client.stats().get("spec_decode", {})
