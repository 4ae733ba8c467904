"""StructuredOutputsParams: vLLM's shape of a structured-output request, checked on construction."""

import dataclasses
import json
from dataclasses import dataclass

from jax_engine.input_checks import check
from jax_engine.structured_output.limits import check_depth

# The kinds of constraint, of which a request sets exactly one (vLLM's rule).
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# A schema, regex or grammar is compiled on the host before admission: bound what one request can ask for.
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 1024
MAX_JSON_DUMPS_DEPTH = 256  # json.dumps overflows Python's recursion limit at ~1,000 levels


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain generation to one of these (set exactly one).

    Args:
        json: a JSON schema (a dict, or its JSON text); the output is a JSON value that validates.
        regex: a regular expression (Rust regex syntax) the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, in Lark (llguidance's dialect) or GBNF (llama.cpp's) syntax.
        json_object: any JSON object (OpenAI's response_format json_object).
        disable_any_whitespace: JSON without whitespace between tokens (compact output).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        check(len(given) == 1, "structured_outputs", f"exactly one of {', '.join(KINDS)}",
              given or "none of them")
        if self.json is not None:
            check(isinstance(self.json, (dict, bool, str)), "structured_outputs.json", "a JSON schema (dict or text)",
                  self.json)
            if isinstance(self.json, dict):  # before json.dumps recurses on it (the tighter limits come at compile)
                check_depth(self.json, "structured_outputs.json", limit=MAX_JSON_DUMPS_DEPTH)
            check(len(self.json_text) <= MAX_SPEC_CHARS, "structured_outputs.json",
                  f"at most {MAX_SPEC_CHARS} characters as JSON", self.json_text)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                check(isinstance(value, str) and 0 < len(value) <= MAX_SPEC_CHARS, f"structured_outputs.{name}",
                      f"a non-empty string of at most {MAX_SPEC_CHARS} characters", value)
        if self.choice is not None:
            check(isinstance(self.choice, (list, tuple)) and 0 < len(self.choice) <= MAX_CHOICES
                  and all(isinstance(c, str) and c for c in self.choice), "structured_outputs.choice",
                  f"a list of 1 to {MAX_CHOICES} non-empty strings", self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))
        check(self.json_object in (None, True, False), "structured_outputs.json_object", "a bool", self.json_object)
        check(isinstance(self.disable_any_whitespace, bool), "structured_outputs.disable_any_whitespace", "a bool",
              self.disable_any_whitespace)

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputsParams":
        """From a dict of its fields (a JSON body); an unknown key is a ValueError naming it."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        check(not unknown, "structured_outputs", f"a dict with keys among {', '.join(KINDS)}, "
              "disable_any_whitespace", unknown)
        return cls(**fields)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def json_text(self) -> str:
        """The JSON schema as text (json=...), or the schema of any object (json_object=True)."""
        if self.json_object:
            return '{"type": "object"}'
        return self.json if isinstance(self.json, str) else json.dumps(self.json)
