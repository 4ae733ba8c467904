"""The table of model families in docs/models.md, made from the registry and the tests that check each one.

`python -m docs.model_table` rewrites the table in the page; tests/test_model_families.py checks it is current.
"""

import pathlib
import re

from jax_engine.models.registry import ARCHITECTURES
from tests.test_model_families import ATTENTION_VARIANTS, GREEDY_VARIANTS, VARIANTS

PAGE = pathlib.Path(__file__).parent / "models.md"
BEGIN, END = "<!-- model table: made by `python -m docs.model_table` -->", "<!-- end of model table -->"


def table() -> str:
    rows = ["| `model_type` | HF class | logits equal to HF's, position by position | greedy text equal to HF's |",
            "| --- | --- | --- | --- |"]
    for name, arch in ARCHITECTURES.items():
        variants = [v for v, (model_type, _) in VARIANTS.items() if model_type == name]
        logits = ", ".join(f"`{v}`" + (" (cpu and xla backends)" if v in ATTENTION_VARIANTS else "") for v in variants)
        greedy = ", ".join(f"`{v}`" for v in variants if v in GREEDY_VARIANTS)
        rows.append(f"| `{name}` | `{arch.hf_class}` | {logits} | {greedy} |")
    return "\n".join(rows)


def page_with_table(text: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    assert pattern.search(text), f"{PAGE.name} has no {BEGIN!r} ... {END!r} section"
    return pattern.sub(lambda _: f"{BEGIN}\n{table()}\n{END}", text)


if __name__ == "__main__":
    PAGE.write_text(page_with_table(PAGE.read_text()))
