"""From a request's StructuredOutputsParams to the one grammar it compiles from, and the check
that this grammar parses.

The check needs no tokenizer (it parses, it does not compile against a vocabulary), so the API
server runs it before a request reaches the engine and answers a bad schema, pattern or grammar
with a 400 naming the field; the engine core runs it again for requests that come another way
(the offline `LLM`). xgrammar is imported on first use: it costs about a second to import and
servers without structured requests never need it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kdaserve.sampling_params import StructuredOutputsParams

GRAMMAR_KINDS = ("json", "regex", "ebnf", "lark")

_EBNF_RULE = re.compile(r"::=")
_COMMENT = re.compile(r"(#|//).*$")


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: `kind` (one of GRAMMAR_KINDS) and its source text. Equal specs compile
    to the same grammar (xgrammar's compiler caches by them)."""

    kind: str
    text: str
    any_whitespace: bool = True
    """JSON only: any whitespace between tokens (else none)."""


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The grammar of a constraint: a JSON schema as its JSON text, `choice` as an EBNF
    alternation of its literal strings, `json_object` as the schema of any object, `grammar` as
    EBNF or (without any `::=` rule) Lark."""
    ws = not params.disable_any_whitespace
    kind = params.kind
    if kind == "json":
        text = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return GrammarSpec("json", text, ws)
    if kind == "json_object":
        return GrammarSpec("json", '{"type": "object"}', ws)
    if kind == "regex":
        return GrammarSpec("regex", params.regex)
    if kind == "choice":
        return GrammarSpec("ebnf", choice_as_ebnf(params.choice))
    return GrammarSpec("ebnf" if _looks_like_ebnf(params.grammar) else "lark", params.grammar)


def choice_as_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b" ...`: each choice as an EBNF string literal (JSON string escapes,
    which xgrammar's EBNF literals read the same way)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _looks_like_ebnf(grammar: str) -> bool:
    """A GBNF/EBNF grammar defines its rules with `::=` (vLLM's test); Lark uses `:`."""
    return any(_EBNF_RULE.search(_COMMENT.sub("", line)) for line in grammar.splitlines())


def parse_grammar(spec: GrammarSpec):
    """The xgrammar Grammar of `spec` (parsed, not compiled). Raises xgrammar's errors."""
    import xgrammar as xgr

    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec.text)
    if spec.kind == "lark":
        return xgr.Grammar.from_lark(spec.text)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def validate_structured_outputs(params: StructuredOutputsParams,
                                field: str | None = None) -> GrammarSpec:
    """Parse the constraint's grammar; returns its spec. Raises ValueError naming `field`
    (default `structured_outputs.<kind>`) with the parser's reason when it does not parse."""
    field = field or f"structured_outputs.{params.kind}"
    if params.kind == "json" and isinstance(params.json, str):
        try:
            schema = json.loads(params.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{field}: a JSON schema is an object, got "
                             f"{type(schema).__name__}")
    try:
        spec = grammar_spec(params)
        parse_grammar(spec)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason
        raise ValueError(f"{field} is not a valid {_WHAT[params.kind]}: "
                         f"{_reason(e)}") from None
    return spec


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "list of choices", "grammar": "grammar"}


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    return text.splitlines()[0] if text else type(exc).__name__
