"""`jax-engine bench serve --compare llama-server BINARY` (issue 48): both servers started by the benchmark, the same
requests to each. llama-server is optional (`make llama-server` builds it); without it the run itself skips."""

import math
import pathlib

import pytest

from jax_engine.cli import build_parser, main

LLAMA_SERVER = pathlib.Path(__file__).parents[1] / "build" / "llama-server" / "bin" / "llama-server"


@pytest.mark.parametrize("compare, error", [(["vllm", "/bin/true"], "the peer must be one of llama-server"),
                                            (["llama-server", "/no/such/binary"], "is not an executable file"),
                                            (["llama-server", "/bin/true", "--rates", "0"], "--rates must be > 0")])
def test_a_wrong_peer_is_refused_before_anything_starts(compare, error):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--compare", *compare])
    assert error in str(exit_info.value.code)


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason=f"llama-server is optional: `make llama-server` builds "
                                                      f"{LLAMA_SERVER.relative_to(LLAMA_SERVER.parents[3])}")
def test_both_servers_serve_the_same_requests(tmp_path, capsys):
    ns = build_parser().parse_args(["bench", "serve", "--compare", "llama-server", str(LLAMA_SERVER),
                                    "--num-prompts", "6", "--rates", "inf", "--quantizations", "gguf",
                                    "--slots", "4", "8", "--max-model-len", "512",
                                    "--log-dir", str(tmp_path)])
    report = ns.run(ns)
    rows = {(row["server"], row.get("chosen", False)): row for row in report["rows"]}
    assert {server for server, _ in rows} == {"jax-engine, gguf", "llama-server, 4 slots", "llama-server, 8 slots"}
    assert sum(chosen for _, chosen in rows) == 1 and all(row["rate"] == math.inf for row in rows.values())
    # The same token ids in and, EOS ignored, the same number of tokens out: llama-server read our workload as ours did.
    assert len({(row["successful_requests"], row["total_input_tokens"], row["total_output_tokens"])
                for row in rows.values()}) == 1
    assert all(row["failed_requests"] == 0 and row["request_throughput"] > 0 for row in rows.values())
    printed = capsys.readouterr().out
    assert "llama-server, 8 slots" in printed and "gguf: served rate at saturation" in printed
