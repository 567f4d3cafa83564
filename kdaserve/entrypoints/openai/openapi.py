# SPDX-License-Identifier: Apache-2.0
"""/openapi.json as the server behaves: the routes read their bodies themselves (to refuse bad
JSON with an OpenAI error), so FastAPI cannot see the request models; this module documents
each route's request body (the pydantic models' schemas), its responses and every error status
it can give, with the OpenAI error body."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from kdaserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest)

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "integer", "null"]}}}}}

_WHY = {400: "Invalid request (body, parameters or Host header)",
        401: "Missing or wrong API key", 404: "Unknown model", 405: "Method not allowed",
        413: "Request body too large", 415: "Request body is not JSON",
        500: "Internal error", 503: "The engine is not running"}

_BODIES = {("/v1/chat/completions", "post"): ChatCompletionRequest,
           ("/v1/completions", "post"): CompletionRequest,
           ("/tokenize", "post"): TokenizeRequest,
           ("/detokenize", "post"): DetokenizeRequest}

_STREAMING = {"/v1/chat/completions", "/v1/completions"}

_TEXT_ROUTES = {"/metrics"}


def _error(status: int) -> dict[str, Any]:
    return {"description": _WHY[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _ok(path: str) -> dict[str, Any]:
    if path in _TEXT_ROUTES:
        return {"description": "Prometheus metrics",
                "content": {"text/plain": {"schema": {"type": "string"}}}}
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if path in _STREAMING:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"description": "Success", "content": content}


def build_openapi(app: FastAPI, model_name: str | None = None) -> dict[str, Any]:
    """model_name: a served name, given as the example of /v1/models/{model_id}."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    refs, defs = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                    ref_template="#/components/schemas/{model}")
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = ERROR_SCHEMA
    doc["components"] = {"schemas": schemas}
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            model = _BODIES.get((path, method))
            statuses = [400, 401]
            if model is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": refs[(model, "validation")]}}}
                statuses += [404, 413, 415, 500, 503]
            elif path.startswith("/v1/models/"):
                statuses += [404]
            if path == "/health":
                statuses += [503]
            for param in op.get("parameters", []):
                if param.get("name") == "model_id" and model_name is not None:
                    param["example"] = model_name
            op["responses"] = {"200": _ok(path), **{str(s): _error(s) for s in statuses}}
    return doc


def install_openapi(app: FastAPI, model_name: str | None = None) -> None:
    """Serve build_openapi(app, model_name) at /openapi.json (computed once)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app, model_name)
        return cache["doc"]

    app.openapi = openapi
