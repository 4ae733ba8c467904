"""Grammar compilation in a process of its own: a grammar that crashes or runs away costs its request a 400.

    server / LLM                                   worker process (this file run as a script)
    ------------                                   ------------------------------------------
    GrammarWorker.compile(kind, spec)  --line-->    build the llguidance grammar, validate it, make a matcher
                                                    and its first mask, in a thread with a small stack
                           ok / error  <--line--    (memory capped by RLIMIT_AS)
    no answer in time, or the process died: kill it, answer ValueError; the next request starts a new one

The grammar library recurses on a grammar's nesting, and a deep one overflows the stack (SIGSEGV): in the
server's process that lost every request in flight. The worker does the same work as the engine does with a
grammar (compile, then a mask) on a 1 MiB stack, where the engine's threads have 2 MiB (the library's mask
threads) or 8 MiB (Python's), so whatever passes here has room to spare there; and a compile that takes too
long or too much memory is stopped here, before the engine sees it.

This file imports only the standard library and llguidance: it starts in well under a second.
"""

import json
import os
import resource
import select
import subprocess
import sys
import threading

import llguidance

WORKER_STACK_BYTES = 1 << 20
WORKER_MEMORY_BYTES = 2 << 30  # address space: the tokenizer and a large grammar fit in a few hundred MB
COMPILE_TIMEOUT_SECONDS = 5.0  # grammars of real use compile in milliseconds
START_TIMEOUT_SECONDS = 60.0  # python, llguidance and the tokenizer (~0.5 s here)
# The library's own budgets, for compiling and for each mask (its defaults, stated here: the engine and the
# worker must use the same).
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def json_schema_text(schema_text: str, compact: bool) -> str:
    """llguidance's JSON grammar with vLLM's whitespace rule: any whitespace, or none (compact)."""
    schema = json.loads(schema_text)
    if compact and isinstance(schema, dict):
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                           "key_separator": ":"}}
    return json.dumps(schema)


def build_grammar(kind: str, spec: str, compact: bool) -> str:
    """The llguidance grammar for a spec of `kind` (StructuredOutputsParams.kind; `spec` is its text: the schema
    as JSON, the choices as a JSON list)."""
    if kind in ("json", "json_object"):
        return llguidance.grammar_from("json_schema", json_schema_text(spec, compact))
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)
    if kind == "regex":
        return llguidance.grammar_from("regex", spec)
    return llguidance.grammar_from("grammar", spec)  # Lark or GBNF, told apart by llguidance


def check_grammar(tokenizer: llguidance.LLTokenizer, kind: str, spec: str, compact: bool) -> dict:
    """{"grammar": text} if the spec compiles and yields a first mask within the library's budgets, else
    {"error": why}."""
    try:
        grammar = build_grammar(kind, spec, compact)
    except (ValueError, TypeError, RecursionError) as error:  # text that does not parse, an unknown format
        return {"error": str(error)}
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits())
    if error:
        return {"error": error.strip()}
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        return {"error": matcher.get_error().strip()}
    return {"grammar": grammar}


class GrammarWorker:
    """The parent's side: one worker process, started on first use, one request at a time."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 timeout: float = COMPILE_TIMEOUT_SECONDS) -> None:
        self._init = json.dumps({"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos": eos_token_ids})
        self.timeout = timeout
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.num_failures = 0  # crashes and timeouts: each one a request turned away and a worker restarted

    def compile(self, kind: str, spec: str, compact: bool, field: str) -> str:
        """The grammar text; ValueError naming `field` if it does not compile, crashes the worker or takes
        longer than the timeout."""
        with self._lock:
            process = self._started()
            answer = self._ask(process, json.dumps({"kind": kind, "spec": spec, "compact": compact}), self.timeout)
        if answer is None:
            raise ValueError(f"{field} is too costly to compile: it crashed the grammar compiler or took longer "
                             f"than {self.timeout:g} s or {WORKER_MEMORY_BYTES >> 20} MiB (nesting too deep, "
                             "repetitions too large)")
        if "error" in answer:
            raise ValueError(f"{field} is invalid: {answer['error'][:500]}")
        return answer["grammar"]

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONSAFEPATH": "1"})
            if self._ask(self._process, self._init, START_TIMEOUT_SECONDS) != {"ready": True}:
                raise RuntimeError("the grammar worker process did not start")
        return self._process

    def _ask(self, process: subprocess.Popen, line: str, timeout: float) -> dict | None:
        """Send one line and read the answer; None (the process killed) if it died or did not answer in time."""
        try:
            process.stdin.write(line.encode() + b"\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], timeout)
            answer = process.stdout.readline() if ready else b""
        except (BrokenPipeError, OSError):
            answer = b""
        if not answer:
            self.num_failures += 1
            process.kill()
            process.wait()
            return None
        return json.loads(answer)

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    __del__ = close


def _serve() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    init = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["vocab_size"], eos_token=init["eos"])
    threading.stack_size(WORKER_STACK_BYTES)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request, answer = json.loads(line), {}
        worker = threading.Thread(target=lambda: answer.update(check_grammar(tokenizer, **request)))
        worker.start()
        worker.join()
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    _serve()
