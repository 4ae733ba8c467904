"""The gpu-check report: report.json (everything) and report.md (targets, steps, the sweep and engine tables, each
step's printed figures), rewritten after every step."""

import json
import pathlib

from jax_engine.bench.gpu_check_sizes import engine_label

VERDICT = {True: "met", False: "**missed**", None: "not judged"}


def _value(value, wanted: str) -> str:
    if isinstance(value, float):
        return f"{value:.1%}" if "%" in wanted else f"{value:.3g}"
    return "-" if value is None else str(value)


def _targets(report: dict) -> list[str]:
    lines = ["| step | target | value | wanted | |", "| --- | --- | ---: | --- | --- |"]
    rows = [(s["name"], t) for s in report["steps"] for t in s["targets"]] + [("all", report["budget"])]
    for step, t in rows:
        lines.append(f"| {step} | {t['name']} | {_value(t['value'], t['target'])} | {t['target']} | "
                     f"{VERDICT[t['met']]} |")
    return lines


def _sweep(figures: dict) -> list[str]:
    header = ("| batch | context | paged (us) | GB/s | of peak | paged, in order (us) | contiguous (us) | of peak "
              "| paging overhead | max diff |")
    lines = [f"Peak {figures['peak_gbps']:.0f} GB/s ({figures['peak_source']}); shape {figures['shape']}.", "",
             header, "|" + " ---: |" * 10]
    for r in figures["rows"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['paged_us']:.1f} | {r['gbps']:.0f} | {r['of_peak']:.1%} | "
                     f"{r['paged_in_order_us']:.1f} | {r['contiguous_us']:.1f} | {r['contiguous_of_peak']:.1%} | "
                     f"{r['overhead']:.1%} | {r['max_diff']:.1e} |")
    return lines


def _parting(t: dict | None) -> str:
    return "-" if t is None else f"{t['position']} ({t['margin']:.3g} nats)"


def _greedy(figures: dict) -> list[str]:
    ties = ", ".join(f"{nats} nats in {dtype}" for dtype, nats in figures["near_tie_nats"].items())
    lines = [f"A near tie: the top two tokens within {ties}.", "",
             "| model | dtype | tokens equal | or parting at near ties | where they part (margin) "
             "| cumulative logprob gap |", "| --- | --- | --- | --- | --- | ---: |"]
    for r in figures["rows"]:
        dtype = engine_label(r["dtype"], r.get("kv_cache_dtype", "auto"))  # reports from before it had caches
        if "error" in r:
            error = " ".join(r["error"].replace("|", "/").split())  # one table cell
            lines.append(f"| {r['model']} | {dtype} | **no** | **no** | {error} | |")
            continue
        lines.append(f"| {r['model']} | {dtype} | {'yes' if r['equal'] else 'no'} | "
                     f"{'yes' if r['agree'] else '**no**'} | {', '.join(map(_parting, r['partings']))} | "
                     f"{r['max_cumulative_logprob_gap']:.1e} |")
    return lines


TABLES = {"kernel_sweep": _sweep, "engine_greedy": _greedy}


def _step(step: dict) -> list[str]:
    lines = [f"## {step['name']}: {'ok' if step['ok'] else 'FAILED'} ({step['seconds']:.1f} s)", ""]
    if step["figures"] and step["name"] in TABLES:
        lines += TABLES[step["name"]](step["figures"]) + [""]
    if step["error"]:
        lines += ["```text", step["error"].rstrip(), "```", ""]
    if step["output"].strip():
        lines += ["Printed:", "", "```text", step["output"][-6000:].rstrip(), "```", ""]
    return lines


def markdown(report: dict) -> str:
    """The report as a page: the verdict, every target beside its figure, then each step."""
    machine = report["machine"]
    summary = (f"Mode: {report['mode']}. Started {report['started']}; {report['seconds']:.0f} s in all. "
               f"Device: {machine['device']} (jax {machine['jax']}). "
               f"Command: `{report['command']}`.")
    lines = [f"# gpu-check: {'passed' if report['ok'] else 'FAILED'}", "", summary, "",
             "| step | result | seconds |", "| --- | --- | ---: |"]
    lines += [f"| {s['name']} | {'ok' if s['ok'] else '**FAILED**'} | {s['seconds']:.1f} |" for s in report["steps"]]
    lines += ["", "## Targets", ""] + _targets(report) + [""]
    for step in report["steps"]:
        lines += _step(step)
    return "\n".join(lines).rstrip() + "\n"


def write_report(report: dict, out: pathlib.Path) -> None:
    """report.json and report.md in `out`."""
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))
