"""`jax-engine bench plot`: throughput against number of requests, per workload and backend, from `--json` reports.

    jax-engine bench throughput --num-requests 16 --compare hf --json > n16.json   (and more sizes)
    jax-engine bench plot n16.json n64.json -o throughput.svg

Writes a plain SVG line chart, so no plotting library is needed. The x-axis (number of requests) is
logarithmic, and a line joins only runs of one workload (length mode) and one backend: runs of different
workloads are not points of one curve. The site's figure (docs/figures/throughput.py) groups its recorded
runs with the same `series`.
"""

import argparse
import json
import math
import re
from collections import defaultdict

WIDTH, HEIGHT, MARGIN = 640, 360, 60
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
DASHES = ["", "6 4", "2 3", "8 3 2 3"]  # one line style per workload


Series = dict[tuple[str, str], list[tuple[int, float]]]


def series(reports: list[dict]) -> Series:
    """(backend, workload) -> [(num_requests, output tokens/s)], sorted by num_requests.

    The workload is the report's length mode ("" in older reports, which lack it). HF static batches of
    different sizes (one per report, as suits its number of requests) are one line.
    """
    points = defaultdict(list)
    for report in reports:
        workload = report["workload"].get("length_mode", "")
        for result in report["results"]:
            backend = re.sub(r"static batches of \d+", "static batches", result["backend"])
            # The requests this backend ran (HF may run a prefix of the trace; older reports lack the field).
            num_requests = result.get("num_requests", report["workload"]["num_requests"])
            points[backend, workload].append((num_requests, result["output_tokens_per_s"]))
    return {key: sorted(p) for key, p in points.items()}


def label(backend: str, workload: str) -> str:
    """A series' name in a legend: its backend, then its workload if the reports name one."""
    return f"{backend}, {workload}" if workload else backend


def svg(lines: Series, title: str) -> str:
    xs = sorted({x for points in lines.values() for x, _ in points})
    log_min, log_max = math.log(xs[0]), math.log(xs[-1])
    y_max = max(y for points in lines.values() for _, y in points) * 1.1
    backends = list(dict.fromkeys(backend for backend, _ in lines))
    workloads = list(dict.fromkeys(workload for _, workload in lines))

    def px(x):  # logarithmic: 16 -> 64 is as far as 250 -> 1000
        if log_max == log_min:
            return WIDTH / 2
        return MARGIN + (math.log(x) - log_min) / (log_max - log_min) * (WIDTH - 2 * MARGIN)

    def py(y):
        return HEIGHT - MARGIN - y / y_max * (HEIGHT - 2 * MARGIN)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
             f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{WIDTH - MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
             f'<line x1="{MARGIN}" y1="{MARGIN}" x2="{MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
             f'<text x="{WIDTH / 2}" y="{HEIGHT - 20}" text-anchor="middle">number of requests (log scale)</text>',
             f'<text x="15" y="{HEIGHT / 2}" transform="rotate(-90 15 {HEIGHT / 2})" text-anchor="middle">'
             f'output tokens/s</text>']
    for x in xs:
        parts.append(f'<line x1="{px(x):.1f}" y1="{HEIGHT - MARGIN}" x2="{px(x):.1f}" y2="{HEIGHT - MARGIN + 4}" '
                     f'stroke="black"/>')
        parts.append(f'<text x="{px(x):.1f}" y="{HEIGHT - MARGIN + 16}" text-anchor="middle">{x}</text>')
    for i in range(5):
        y = y_max * i / 4
        parts.append(f'<text x="{MARGIN - 6}" y="{py(y) + 4}" text-anchor="end">{y:.0f}</text>')
    for i, ((backend, workload), points) in enumerate(lines.items()):
        color = COLORS[backends.index(backend) % len(COLORS)]
        dash = DASHES[workloads.index(workload) % len(DASHES)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        dasharray = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dasharray}/>')
        parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in points]
        parts.append(f'<line x1="{MARGIN + 10}" y1="{MARGIN + 16 * i - 4}" x2="{MARGIN + 30}" y2="{MARGIN + 16 * i - 4}" '
                     f'stroke="{color}" stroke-width="2"{dasharray}/>')
        parts.append(f'<text x="{MARGIN + 36}" y="{MARGIN + 16 * i}" fill="{color}">{label(backend, workload)}</text>')
    return "\n".join(parts + ["</svg>"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reports", nargs="+", help="JSON files written by bench throughput --json")
    parser.add_argument("-o", "--output", required=True, help="SVG file to write")
    parser.add_argument("--title", default="Offline throughput, SmolLM2-135M, 2-core CPU")


def main(ns: argparse.Namespace) -> None:
    reports = []
    for path in ns.reports:
        with open(path) as f:
            reports.append(json.load(f))
    with open(ns.output, "w") as f:
        f.write(svg(series(reports), ns.title))
    print(f"wrote {ns.output}")
