# SPDX-License-Identifier: Apache-2.0
"""A request body -> a JSON object, refusing what Python's json accepts but the rest of the
server cannot handle: NaN / Infinity (and numbers too large for a float), nesting deeper than
MAX_DEPTH, and lone UTF-16 surrogates (`"\\ud800"`), which are no Unicode text and break every
encoder downstream (tokenizer, detokenizer, logs)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects a body may have (tool schemas need a dozen levels)."""

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyError(ValueError):
    """The body is not a JSON object the server accepts; the message says why."""


def _no_constant(name: str) -> Any:
    raise BodyError(f"invalid JSON body: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(f"invalid JSON body: the number {text[:40]} is out of range")
    return value


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(f"invalid JSON body: nested deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise BodyError(f"the body must be a JSON object, got {type(data).__name__}")
    _check(data, check_strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return data


def _check(data: Any, check_strings: bool) -> None:
    """Depth limit over the whole body (iterative); with check_strings, no lone surrogate in
    any string or key."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > MAX_DEPTH:
                raise BodyError(f"invalid JSON body: nested deeper than {MAX_DEPTH} levels")
            for k, v in value.items():
                if check_strings:
                    _check_text(k)
                if isinstance(v, (dict, list)):
                    stack.append((v, depth + 1))
                elif check_strings and isinstance(v, str):
                    _check_text(v)
        elif isinstance(value, list):
            if depth > MAX_DEPTH:
                raise BodyError(f"invalid JSON body: nested deeper than {MAX_DEPTH} levels")
            for v in value:
                if isinstance(v, (dict, list)):
                    stack.append((v, depth + 1))
                elif check_strings and isinstance(v, str):
                    _check_text(v)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start]
        raise BodyError(f"invalid JSON body: a string holds the lone UTF-16 surrogate "
                        f"\\u{ord(bad):04x}, which is not Unicode text") from None
