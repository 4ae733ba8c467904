"""`jax-engine` (also `python -m jax_engine`): generate from the command line, or chat interactively."""

import argparse
import importlib
import sys

from jax_engine import gc_heap
from jax_engine.engine_core.launch import start_early


def _llm(ns: argparse.Namespace):
    from jax_engine.config import EngineArgs
    from jax_engine.llm import LLM
    from jax_engine.llm_engine import LLMEngine

    return LLM.from_engine(LLMEngine(EngineArgs.from_cli_args(ns)))


def _sampling(ns: argparse.Namespace):
    from jax_engine.sampling_params import SamplingParams

    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.sampling_seed,
                          max_tokens=ns.max_tokens)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def _chat_template(ns: argparse.Namespace) -> str | None:
    """--chat-template's template (a file, or the template itself), checked before the model loads."""
    from jax_engine.chat_template import load_chat_template

    return load_chat_template(ns.chat_template)


def generate(ns: argparse.Namespace) -> None:
    if ns.chat_template is not None and not ns.chat:
        raise ValueError("--chat-template renders chat prompts: it needs --chat")
    template = _chat_template(ns)
    llm = _llm(ns)
    params = _sampling(ns)
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], params, use_tqdm=False,
                           chat_template=template)
    else:
        outputs = llm.generate(ns.prompts, params, use_tqdm=False)
    for output in outputs:
        print(output.outputs[0].text if ns.chat else output.prompt + output.outputs[0].text)


def chat(ns: argparse.Namespace) -> None:
    template = _chat_template(ns)
    llm = _llm(ns)
    params, conversation = _sampling(ns), []
    print("Chatting with the model. Type /exit or press Ctrl-D to leave.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() == "/exit":
            break
        conversation.append({"role": "user", "content": line})
        [output] = llm.chat(conversation, params, use_tqdm=False, chat_template=template)
        reply = output.outputs[0].text.strip()
        conversation.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def build_parser(for_serve: bool = False) -> argparse.ArgumentParser:
    """Every command's flags; `for_serve`: generate's, chat's and serve's alone, which need neither the server nor
    the benchmarks imported, so that `serve` hands its engine core its arguments ~0.7 s sooner."""
    # Imported here, not above: main() starts `serve`'s engine core process before these imports (launch.py).
    from jax_engine.config import EngineArgs
    from jax_engine.server import serve as serve_command, serve_flags
    from jax_engine.server.server_config import add_chat_template_argument

    parser = argparse.ArgumentParser(prog="jax-engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts and print the results")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    chat_parser = commands.add_parser("chat", help="interactive chat on stdin")
    for sub, run in ((gen, generate), (chat_parser, chat)):
        EngineArgs.add_cli_args(sub)
        _add_sampling_args(sub)
        add_chat_template_argument(sub)
        sub.set_defaults(run=run)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    serve_flags.add_arguments(serve)
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(run=serve_command.main)
    if for_serve:
        return parser
    from jax_engine.server import run_batch as run_batch_command

    batch = commands.add_parser("run-batch", help="run an OpenAI batch file (JSON lines) offline, as vLLM's run-batch")
    run_batch_command.add_arguments(batch)
    EngineArgs.add_cli_args(batch)
    batch.set_defaults(run=run_batch_command.main)
    for name, module_name, help_text in (("simulate", "simulator.cli", "the paper's systems at GPU scale, simulated"),
                                         ("plan", "simulator.plan", "KV cache, sequences and request rate a device "
                                                                    "serves")):
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    bench = commands.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    for name in ("throughput", "latency", "quality", "serve", "soak", "sharing", "batching", "kernels", "preemption",
                 "parallel", "structured", "plot", "simulation", "lora"):
        module = importlib.import_module(f"jax_engine.bench.{name}")
        sub = benchmarks.add_parser(name, help=module.__doc__.splitlines()[0])
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with gc_heap.paused():  # the imports' objects all live on (jax_engine/gc_heap.py)
        start_early(argv)  # `serve`: the engine core process imports the engine while this one imports the server
        ns = build_parser(for_serve=argv[:1] == ["serve"]).parse_args(argv)
    gc_heap.freeze()  # `serve`: while the engine core loads the model
    try:
        ns.run(ns)
    except (ValueError, FileNotFoundError) as error:  # bad arguments, prompts or paths: a message, not a traceback
        sys.exit(f"jax-engine: error: {error}")
