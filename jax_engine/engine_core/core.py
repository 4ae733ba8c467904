"""The engine core process (vLLM v1's EngineCore): the scheduler and the model, in a process of their own.

    API server process (core_client.py)            engine core process (here)
    -----------------------------------            --------------------------
    HTTP, tokenization, grammars           ---->   take every input that has arrived (never waiting for one
    AsyncLLMEngine over EngineCoreClient           while there is work), then step the LLMEngine
    text, stop strings, streams            <----   the step's outputs (token ids, no text) and the engine's state

The core steps for as long as it has work, without waiting for the API server to read what it sent: the
server's HTTP and streaming work and the core's steps run at once, on different cores. A request with a grammar
joins the engine once a thread has built its matcher (grammar_builds.py), never holding up the steps. When idle,
the core blocks on its input sockets. It ends once every API server has sent "shutdown", when the process that started
it is gone, or on an error of its loop, which it reports ("dead", with the traceback) before it exits with status 1.
An engine its flags or model cannot start is "refused", with the engine's own error, which `serve` prints as a
bad flag's.

With `--api-server-count N` (jax_engine/server/api_servers.py) N API servers share the core, each over a pair of
sockets of its own: the core remembers which one added each request and sends each its own requests' outputs,
and all of them the engine's state.
"""

import logging
import os
import pickle
import signal
import sys
import traceback

import zmq

from jax_engine import gc_heap
from jax_engine.config import EngineArgs
from jax_engine.distributed.replica_devices import replica_devices
from jax_engine.engine_core.grammar_builds import BUILD_POLL_MS, GrammarBuilds
from jax_engine.engine_core.messages import AddRequest, CoreOutputs, EngineFacts, decode, encode
from jax_engine.engine_core.output_deltas import DeltaEncoder
from jax_engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
PARENT_CHECK_MS = 1000  # how often an idle core checks that the API server is still there
LAST_WORD_MS = 5000  # how long a stopping core waits for its last message (outputs, or why it died) to go out
# ... and one that cannot start: the API servers started beside it (api_servers.py), or the `jax-engine serve` that
# started it early (launch.py), bind their sockets only after their imports, which take seconds, more on a busy
# machine; it exits as soon as they have its word.
START_LAST_WORD_MS = 60_000


class EngineCore:
    """An LLMEngine driven by the messages of its API servers: API server i sends on inputs[i] and reads outputs[i]
    (see the module docstring)."""

    def __init__(self, engine: LLMEngine, inputs: list[zmq.Socket], outputs: list[zmq.Socket]) -> None:
        self.engine = engine
        self._inputs, self._outputs = inputs, outputs
        self._poller = zmq.Poller()
        for socket in inputs:
            self._poller.register(socket, zmq.POLLIN)
        self._adds_applied = [0] * len(inputs)
        self._server_of: dict[str, int] = {}  # unfinished request id -> the API server that added it
        self._attached = set(range(len(inputs)))  # the API servers that have not said "shutdown"
        self._deltas = DeltaEncoder()
        self._builds = GrammarBuilds(engine.grammar_compiler.from_text, engine.grammar_compiler.prepare)

    def run(self) -> None:
        parent = os.getppid()
        while self._attached:
            if os.getppid() != parent:  # its API server (or their supervisor) died without a word
                logger.error("the process that started the engine core is gone: the engine core stops")
                return
            idle = not self.engine.has_unfinished_requests()
            wait_ms = (BUILD_POLL_MS if self._builds else PARENT_CHECK_MS) if idle else 0
            took = self._take_inputs(wait_ms)
            if not self._add_built() and not took and idle:
                continue
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            self._send_outputs(outputs)

    def _take_inputs(self, wait_ms: int) -> bool:
        """Apply every message waiting on the input sockets (after waiting up to `wait_ms` for the first)."""
        took = False
        while ready := dict(self._poller.poll(wait_ms if not took else 0)):
            for server, socket in enumerate(self._inputs):
                if socket in ready:
                    self._apply(server, *decode(socket.recv()))
            took = True
        return took

    def _apply(self, server: int, kind: str, body) -> None:
        if kind == "add":
            self._add(server, body)
        elif kind == "abort":
            self.engine.abort_request(body)
            self._builds.abort(body)
        elif kind == "stop":
            self.engine.stop_sequences(body)
        elif kind in ("add_lora", "remove_lora"):
            self._update_adapters(kind, body)
        elif kind == "tokenizer":  # each API server's first word: the grammars' tokenizer, as JSON
            self.engine.grammar_compiler.use_tokenizer_json(body)
            self._builds.prepare()
        elif kind == "shutdown":  # that API server is gone: its requests (none, after a drain) end with it
            self._attached.discard(server)
            self.engine.abort_request([r for r, s in self._server_of.items() if s == server])
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _update_adapters(self, kind: str, body) -> None:
        """Load or forget a LoRA adapter. The API server checked the adapter's files and sends a removal once its
        requests with it are done: an error here is a change on disk meanwhile, or a race, and is only logged."""
        try:
            if kind == "add_lora":
                self.engine.add_lora(body)
            else:
                self.engine.remove_lora(body)
        except ValueError as error:
            logger.error("%s failed: %s", kind, error)

    def _add(self, server: int, request: AddRequest) -> None:
        if request.grammar_text is not None:  # it joins the engine once its grammar is built (grammar_builds.py)
            self._builds.submit(server, request)
        else:
            self._add_to_engine(server, request)

    def _add_built(self) -> bool:
        """Add the requests whose grammar has been built; True if any build finished."""
        built = self._builds.ready()
        for server, request, build, aborted in built:
            if server not in self._attached:  # its API server is gone
                continue
            try:
                grammar = build.result()
            except Exception as error:  # checked in the API server's grammar worker: not expected
                logger.exception("the grammar of request %s could not be built", request.request_id)
                self._adds_applied[server] += 1
                self._outputs[server].send(encode("rejected", (request.request_id, ValueError(str(error)))))
                continue
            request.params._set("compiled_grammar", grammar)
            self._add_to_engine(server, request)
            if aborted:  # while its grammar was building: it ends as any abort does, with a last output
                self.engine.abort_request([request.request_id])
        return bool(built)

    def _add_to_engine(self, server: int, request: AddRequest) -> None:
        self._adds_applied[server] += 1
        params = request.params
        try:
            self.engine.add_request(request.request_id, request.prompt, params, lora_request=request.lora_request,
                                    priority=request.priority)
        except ValueError as error:  # checked in the API server: only a difference of state (or of two API
            self._outputs[server].send(encode("rejected", (request.request_id, error)))  # servers' ids) gets here
            return
        self._server_of[request.request_id] = server

    def _send_outputs(self, outputs: list) -> None:
        """Each attached API server gets its own requests' outputs and the engine's state."""
        mine = [[] for _ in self._outputs]
        for output in outputs:
            server = self._server_of.pop(output.request_id) if output.finished else self._server_of[output.request_id]
            mine[server].append(self._deltas.encode(output))
        scheduler = self.engine.scheduler
        state = (len(scheduler.waiting), len(scheduler.running), self.engine.stats())
        for server in self._attached:
            self._outputs[server].send(encode("outputs", CoreOutputs(mine[server], self._adds_applied[server], *state)))


def engine_facts(engine: LLMEngine) -> EngineFacts:
    lora = engine.runner.lora
    return EngineFacts(engine.model_config, engine.scheduler_config, engine.eos_token_ids,
                       engine.default_sampling_fields, engine.speculator is not None, lora and lora.checker,
                       engine.startup_compile_seconds, engine.stats())


def run_engine_core(args: EngineArgs, addresses: list[tuple[str, str]], log_level: str = "INFO",
                    replica: int | None = None) -> None:
    """The engine core process's main: load the engine, say "ready", serve the API servers until they stop.

    `addresses`: each API server's (input, output) socket addresses, which it binds and the core connects to.
    `replica`: which data-parallel replica this core is (its devices: distributed/replica_devices.py).
    """
    name = "engine-core" if replica is None else f"engine-core-dp{replica}"
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s {name} %(name)s: %(message)s")
    # Ctrl-C and a supervisor's SIGTERM reach the whole process group: the API server drains its requests and
    # then stops the core ("shutdown"), which must not die under them first.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    context = zmq.Context()
    inputs = [_connected(context, zmq.PULL, address) for address, _ in addresses]
    outputs = [_connected(context, zmq.PUSH, address) for _, address in addresses]
    try:
        devices = None if replica is None else replica_devices(args)[replica]
        # The API servers make the text; the programs load while the API servers start and wait for requests.
        engine = LLMEngine(args, devices=devices, detokenize=False, background_loads=True)
    except (ValueError, FileNotFoundError) as error:  # the flags or the model's path: the server says so in a line
        logger.error("the engine core cannot start: %s", error)
        _last_word(context, outputs, "refused", str(error), START_LAST_WORD_MS)
    except BaseException:
        logger.exception("the engine core died while starting")
        _last_word(context, outputs, "dead", traceback.format_exc(), START_LAST_WORD_MS)
    try:
        for socket in outputs:
            socket.send(encode("ready", engine_facts(engine)))
        gc_heap.freeze()  # start-up is over (launch.py paused the collector), while the API servers start theirs
        EngineCore(engine, inputs, outputs).run()
    except BaseException:
        logger.exception("the engine core died")
        _last_word(context, outputs, "dead", traceback.format_exc())
    context.destroy(linger=LAST_WORD_MS)


def _last_word(context: zmq.Context, outputs: list[zmq.Socket], kind: str, body: str,
               linger_ms: int = LAST_WORD_MS) -> None:
    """Tell every API server why this core stops (waiting up to `linger_ms` for it to go out), and exit 1."""
    for socket in outputs:
        socket.send(encode(kind, body))
    context.destroy(linger=linger_ms)
    sys.exit(1)


def _connected(context: zmq.Context, kind: int, address: str) -> zmq.Socket:
    socket = context.socket(kind)
    socket.connect(address)
    return socket


if __name__ == "__main__":  # started by launch.py; its arguments come on stdin once the imports above are done
    try:
        arguments = pickle.load(sys.stdin.buffer)
    except EOFError:  # the server exited before it wrote them
        sys.exit("engine core: no arguments came (the server that started it is gone)")
    run_engine_core(*arguments)
