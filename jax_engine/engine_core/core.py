"""The engine core process (vLLM v1's EngineCore): the scheduler and the model, in a process of their own.

    API server process (core_client.py)            engine core process (here)
    -----------------------------------            --------------------------
    HTTP, tokenization, grammars, streams  ---->   take every input that has arrived (never waiting for one
    AsyncLLMEngine over EngineCoreClient           while there is work), then step the LLMEngine
                                           <----   the step's outputs and the engine's state

The core steps for as long as it has work, without waiting for the API server to read what it sent: the
server's HTTP and streaming work and the core's steps run at once, on different cores. When idle, the core
blocks on its input socket. It ends on a "shutdown" message, when the process that started it is gone, or on
an error of its loop, which it reports ("dead", with the traceback) before it exits with status 1.
"""

import logging
import os
import pickle
import signal
import sys
import traceback

import zmq

from jax_engine.config import EngineArgs
from jax_engine.engine_core.messages import AddRequest, CoreOutputs, EngineFacts, decode, encode
from jax_engine.engine_core.output_deltas import DeltaEncoder
from jax_engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
PARENT_CHECK_MS = 1000  # how often an idle core checks that the API server is still there
LAST_WORD_MS = 5000  # how long a stopping core waits for its last message (outputs, or why it died) to go out


class EngineCore:
    """An LLMEngine driven by the messages of one API server (see the module docstring)."""

    def __init__(self, engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.engine = engine
        self._inputs, self._outputs = inputs, outputs
        self._adds_applied = 0
        self._deltas = DeltaEncoder()
        self._running = True

    def run(self) -> None:
        parent = os.getppid()
        while self._running:
            if os.getppid() != parent:  # the API server died without a word: nobody would read our outputs
                logger.error("the API server process is gone: the engine core stops")
                return
            idle = not self.engine.has_unfinished_requests()
            if not self._take_inputs(wait_ms=PARENT_CHECK_MS if idle else 0) and idle:
                continue
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            self._send_outputs(outputs)

    def _take_inputs(self, wait_ms: int) -> bool:
        """Apply every message waiting on the input socket (after waiting up to `wait_ms` for the first)."""
        took = False
        while self._inputs.poll(wait_ms if not took else 0):
            self._apply(*decode(self._inputs.recv()))
            took = True
        return took

    def _apply(self, kind: str, body) -> None:
        if kind == "add":
            self._add(body)
        elif kind == "abort":
            self.engine.abort_request(body)
        elif kind == "shutdown":
            self._running = False
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _add(self, request: AddRequest) -> None:
        self._adds_applied += 1
        params = request.params
        if request.grammar_text is not None:
            params._set("compiled_grammar", self.engine.grammar_compiler.from_text(request.grammar_text))
        try:
            self.engine.add_request(request.request_id, request.prompt, params, lora_request=request.lora_request)
        except ValueError as error:  # checked in the API server: only a difference of state could get here
            self._outputs.send(encode("rejected", (request.request_id, error)))

    def _send_outputs(self, outputs: list) -> None:
        scheduler = self.engine.scheduler
        stats = self.engine.stats()
        self._outputs.send(encode("outputs", CoreOutputs([self._deltas.encode(o) for o in outputs], self._adds_applied,
                                                         len(scheduler.waiting), len(scheduler.running), stats)))


def engine_facts(engine: LLMEngine) -> EngineFacts:
    return EngineFacts(engine.model_config, engine.scheduler_config, engine.tokenizer, engine.eos_token_ids,
                       engine.default_sampling_fields, engine.speculator is not None, engine.startup_compile_seconds,
                       engine.stats())


def run_engine_core(args: EngineArgs, input_address: str, output_address: str, log_level: str = "INFO") -> None:
    """The engine core process's main: load the engine, say "ready", serve the API server until told to stop."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s engine-core %(name)s: %(message)s")
    # Ctrl-C and a supervisor's SIGTERM reach the whole process group: the API server drains its requests and
    # then stops the core ("shutdown"), which must not die under them first.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    try:
        engine = LLMEngine(args)
        outputs.send(encode("ready", engine_facts(engine)))
        EngineCore(engine, inputs, outputs).run()
    except BaseException:
        logger.exception("the engine core died")
        outputs.send(encode("dead", traceback.format_exc()))
        context.destroy(linger=LAST_WORD_MS)
        sys.exit(1)
    context.destroy(linger=LAST_WORD_MS)


if __name__ == "__main__":  # started by launch.py; its arguments come on stdin once the imports above are done
    try:
        arguments = pickle.load(sys.stdin.buffer)
    except EOFError:  # the server exited before it wrote them
        sys.exit("engine core: no arguments came (the server that started it is gone)")
    run_engine_core(*arguments)
