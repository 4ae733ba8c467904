"""Bounds on a grammar request, checked before any grammar library sees it.

A schema, regex or grammar is a program the server compiles. The grammar library (Rust) recurses on
nesting: a Lark grammar of 3,000 chained rules, or a JSON schema of 2,000 chained `$ref`s, overflows its stack
and kills the process. Nested counted repetitions multiply: the 15 characters `(x{1000}){1000}` cost 1.7 s
for one mask. These checks turn such requests away with a 400 that names the field and the limit; what
passes them is compiled in a separate process anyway (worker.py), so a case they miss costs that request
alone.
"""

import json
import re

from jax_engine.input_checks import check

MAX_SCHEMA_DEPTH = 64  # nesting of the schema document's objects and lists
MAX_SCHEMA_REFS = 256  # "$ref"s in one schema
MAX_GRAMMAR_RULES = 1000  # rule definitions in one Lark or GBNF grammar
MAX_REPETITION = 10_000  # the product of nested counted repetitions ({n}, {m,n}) in a regex

_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.-]*(\.-?\d+)?\s*(:|::=)", re.MULTILINE)
_COUNTED = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def check_spec(kind: str, text: str, field: str) -> None:
    """Raise ValueError naming `field` if a spec of `kind` ("json", "regex", "grammar", ...) passes a limit."""
    if kind in ("json", "json_object"):
        check_schema(json.loads(text), field)
    elif kind == "regex":
        check_regex(text, field)
    elif kind == "grammar":
        rules = len(_RULE.findall(text))
        check(rules <= MAX_GRAMMAR_RULES, field, f"a grammar of at most {MAX_GRAMMAR_RULES} rules", f"{rules} rules")
        check_regex(text, field)  # its terminals' regexes (braces elsewhere only make the check stricter)


def check_depth(value, field: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """`value` (JSON: dicts and lists) nests at most `limit` levels, walked without recursion (json.dumps and
    json.loads recurse, and overflow Python's recursion limit at ~1,000 levels)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        check(depth <= limit, field, f"a schema nested at most {limit} levels deep", "a deeper one")
        if isinstance(node, dict):
            stack += [(child, depth + 1) for child in node.values()]
        elif isinstance(node, list):
            stack += [(child, depth + 1) for child in node]


def check_schema(schema, field: str) -> None:
    """Depth, `$ref` count and every `pattern`'s repetitions, walked without recursion (the depth is the point)."""
    refs, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        check(depth <= MAX_SCHEMA_DEPTH, field, f"a schema nested at most {MAX_SCHEMA_DEPTH} levels deep",
              "a deeper one")
        if isinstance(node, dict):
            refs += "$ref" in node
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], f"{field} pattern")
            stack += [(value, depth + 1) for value in node.values()]
        elif isinstance(node, list):
            stack += [(value, depth + 1) for value in node]
    check(refs <= MAX_SCHEMA_REFS, field, f"a schema with at most {MAX_SCHEMA_REFS} $refs", f"{refs} $refs")


def check_regex(regex: str, field: str) -> None:
    """The product of the counted repetitions nested in `regex` (by its parentheses) is at most MAX_REPETITION."""
    inner = [1]  # per open group: the largest repetition product inside it so far
    i = 0
    while i < len(regex):
        char, value = regex[i], None
        if char == "\\":
            i += 2
            continue
        if char == "(":
            inner.append(1)
        elif char == ")" and len(inner) > 1:
            value = inner.pop()  # a count right after the group multiplies what is inside it
        i += 1
        match = _COUNTED.match(regex, i if char == ")" else i - 1)
        if match and (match.group(1) or match.group(2)):
            value = (value or 1) * max(int(match.group(1) or 0), int(match.group(2) or 0), 1)
            i = match.end()
        if value is not None:
            inner[-1] = max(inner[-1], value)
    largest = max(inner)
    check(largest <= MAX_REPETITION, field, f"nested counted repetitions ({{n}}) whose product is at most "
          f"{MAX_REPETITION}", f"{largest}")
