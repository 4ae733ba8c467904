"""The JSON values a request body holds: how deep they nest (counted without recursion), and whether their text
is valid Unicode (a lone surrogate is refused before it reaches the tokenizer)."""

import json
from typing import Annotated

from pydantic import AfterValidator

from jax_engine.input_checks import is_unicode

# JSON values (schemas, tool parameters and arguments) nest at most this deep: far more than any real schema, and
# far from Python's recursion limit, which json, pydantic and the grammar code would otherwise hit as a 500.
MAX_JSON_DEPTH = 128
_NOT_UNICODE = "not valid Unicode (it holds a lone surrogate)"


def _unicode(text: str) -> str:
    if not is_unicode(text):
        raise ValueError(_NOT_UNICODE)
    return text


def json_depth(value) -> int:
    """How deep lists and dicts nest in a JSON value (a scalar: 0), counted without recursion; it stops counting
    past MAX_JSON_DEPTH."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_JSON_DEPTH:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _nesting(value) -> int:
    """json_depth of a JSON value, or of JSON text (0 for other text: it is used as text, or refused by whatever
    parses it)."""
    if not isinstance(value, str):
        return json_depth(value)
    try:
        return json_depth(json.loads(value))
    except RecursionError:
        return MAX_JSON_DEPTH + 1
    except ValueError:
        return 0


def _shallow(value):
    if _nesting(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _strings(value):
    """Every string in a JSON value, dict keys included."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item


def check_json_fields(fields: dict) -> None:
    """A ValueError naming the first field that nests too deep or holds text that is not Unicode (for bodies
    whose fields pydantic does not check: /generate's)."""
    for name, value in fields.items():
        if json_depth(value) > MAX_JSON_DEPTH:
            raise ValueError(f"{name} nests deeper than {MAX_JSON_DEPTH} levels")
        if not all(map(is_unicode, _strings(value))):
            raise ValueError(f"{name} is {_NOT_UNICODE}")


Text = Annotated[str, AfterValidator(_unicode)]
Shallow = AfterValidator(_shallow)
