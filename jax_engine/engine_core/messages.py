"""What the API server process and the engine core process say to each other, and how it goes over ZMQ.

    API server -> engine core (one socket)         engine core -> API server (another socket)
    ---------------------------------------        ------------------------------------------
    ("tokenizer", tokenizer JSON)  on "ready"      ("ready", EngineFacts)        once, after start-up
    ("add", AddRequest)
    ("abort", [request ids])                       ("outputs", CoreOutputs)      after every step or input
    ("stop", [(request id, index, stop string)])   ("rejected", (request id, error))  an add it refused
    ("add_lora", LoRARequest)                      ("dead", traceback text)      the core's loop failed
    ("remove_lora", adapter id)                    ("refused", error message)    its flags or model could not
    ("shutdown", None)                                                           start an engine (a ValueError)

Messages are pickled (protocol 5): both ends are this package in processes of one user, on a socket in a
directory only that user can open. Outputs travel as what changed since the last one (output_deltas.py): the
API server has the prompt and the rest already. They carry no text: the API server makes it, and says "stop" for
the completions whose text reached a stop string (text_processor.py).
"""

import pickle
from dataclasses import dataclass, field

from jax_engine.lora.request import LoRARequest
from jax_engine.model_config import ModelConfig
from reference.scheduler import SchedulerConfig


@dataclass
class EngineFacts:
    """What the API server needs of the loaded engine to check and tokenize requests itself."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    eos_token_ids: tuple[int, ...]
    default_sampling_fields: dict
    speculative: bool  # whether speculative decoding is on (its counters come with the outputs)
    lora_checker: object | None  # an AdapterChecker with --enable-lora: the API server checks adapters itself
    startup_compile_seconds: float
    stats: dict  # LLMEngine.stats() at start-up


@dataclass
class AddRequest:
    """A request the API server checked and tokenized, as AsyncLLMEngine lets it into the engine.

    `params` travel as params_for_core makes them: `grammar_text` is the compiled grammar's llguidance text, already
    checked in the API server's grammar worker, which the core builds a matcher from.
    """

    request_id: str
    prompt: dict
    params: object
    lora_request: LoRARequest | None = None
    grammar_text: str | None = None
    priority: int = 0  # its place in the core's queues under scheduling_policy "priority"


@dataclass
class CoreOutputs:
    """One turn of the core: the outputs of its step (if it stepped) and its state after it.

    `adds_applied` counts every add the core has taken since it started: the API server counts the adds it sent
    past that number as waiting too (its backpressure sees them before the core reports them).
    """

    outputs: list  # OutputDelta, or PoolingRequestOutput
    adds_applied: int
    num_waiting: int
    num_running: int
    stats: dict = field(default_factory=dict)


def params_for_core(params):
    """A checked request's params as they travel to the core: without the compiled grammar (an llguidance matcher
    does not pickle; AddRequest.grammar_text carries its text), and with allowed_token_ids made into their mask
    (the API server's input processor made it) and left empty: the core samples from the mask alone
    (allowed_token_mask). A request may list 2^20 ids: 2-5 MB pickled, 14-60 ms of unpickling and ~40 of checking
    again in the core's loop, which every running request waits for; the mask is vocab_size / 8 bytes."""
    if getattr(params, "compiled_grammar", None) is not None:
        params = params.derived(compiled_grammar=None)
    if getattr(params, "allowed_mask", None) is not None:
        params = params.derived(allowed_token_ids=())
    return params


def encode(kind: str, body) -> bytes:
    return pickle.dumps((kind, body), protocol=5)


def decode(frame: bytes) -> tuple[str, object]:
    return pickle.loads(frame)
