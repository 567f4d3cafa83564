# SPDX-License-Identifier: Apache-2.0
"""OpenAI request models (pydantic) and the small builders for response bodies.

Requests are validated here; unknown fields are ignored (clients send many). A field that is
declared is honoured or, where kdaserve cannot honour it, refused at any value but its neutral
one (VllmUnsupportedFields): a vLLM user never gets a 200 that silently ignored it. Responses
are plain dicts built by the serving classes: the exact set of fields is part of the wire
contract and easier to see as literals than as `exclude_unset` models.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kdaserve.sampling_params import StructuredOutputsParams
from kdaserve.structured_output.spec import validate_structured_outputs

_MAX_SEED = 2**63 - 1


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search, which is not supported"),
    "prompt_logprobs": ((None,), "prompt logprobs are not supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported; use logit_bias"),
    "bad_words": ((None, []), "bad_words is not supported; use logit_bias"),
    "logprob_token_ids": ((None,), "logprob_token_ids is not supported"),
    "spaces_between_special_tokens": ((True,), "only spaces_between_special_tokens=true is "
                                               "supported"),
    "priority": ((0,), "priority scheduling is not supported (only priority 0)"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not "
                                                  "supported"),
    "vllm_xargs": ((None,), "vllm_xargs is not supported"),
    "thinking_token_budget": ((None,), "thinking_token_budget is not supported"),
    "functions": ((None,), "the legacy `functions` parameter is not supported; use `tools`"),
    "function_call": ((None,), "the legacy `function_call` parameter is not supported; use "
                               "`tool_choice`"),
    "mm_processor_kwargs": ((None, {}), "this model takes text only"),
    "media_io_kwargs": ((None, {}), "this model takes text only"),
}
"""vLLM's request fields that kdaserve cannot honour -> (their neutral values, why). Given at
any other value they are a 400 that names them."""

_CHAT_ONLY_UNSUPPORTED = ("functions", "function_call", "mm_processor_kwargs", "media_io_kwargs")


class VllmUnsupportedFields(OpenAIBaseModel):
    """vLLM extensions declared so that a request using them is refused, not ignored."""

    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprob_token_ids: list[int] | None = None
    spaces_between_special_tokens: bool = True
    priority: int = 0
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    vllm_xargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None

    @field_validator(*[name for name in _UNSUPPORTED if name not in _CHAT_ONLY_UNSUPPORTED])
    @classmethod
    def _refuse(cls, v, info):
        return refuse_unless_neutral(v, info.field_name)


def refuse_unless_neutral(value: Any, name: str) -> Any:
    neutral, why = _UNSUPPORTED[name]
    if value not in neutral:
        raise ValueError(f"{name}={value!r} is not supported: {why}")
    return value


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(OpenAIBaseModel):
    """One input message. Content parts other than text are rejected (text-only model)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type") not in ("text", "input_text") or not isinstance(
                        part.get("text"), str):
                    raise ValueError(
                        f"only text content parts are supported, got part type "
                        f"{part.get('type')!r}")
        return v

    def to_template_dict(self) -> dict[str, Any]:
        """The dict handed to the chat template: text parts joined, reasoning normalised."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(part["text"] for part in self.content)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            d["reasoning_content"] = reasoning
            d["reasoning"] = reasoning
        return d


# ------------------------------------------------------------------------- structured outputs
# OpenAI's response_format, vLLM's structured_outputs object and its legacy guided_* fields,
# and (chat) tool_choice "required" / a named function: each becomes one StructuredOutputsParams.


class JsonSchemaFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError('response_format type "json_schema" needs json_schema.schema')
        return self


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` object: one constraint, or only options (then the constraint
    comes from response_format, a guided_* field or tool_choice). Keys it cannot honour
    (structural_tag, whitespace_pattern, ...) are refused, not ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    """Honoured as is: there is one backend and no fallback."""
    disable_additional_properties: bool = False
    """Honoured as is: xgrammar never adds properties a schema does not allow."""

    def constraint(self) -> dict[str, Any]:
        """The StructuredOutputsParams fields of its constraint ({} when it has none)."""
        values = {"json": self.json_schema, "regex": self.regex, "choice": self.choice,
                  "grammar": self.grammar, "json_object": self.json_object or None}
        return {k: v for k, v in values.items() if v is not None}


class StructuredOutputFields(OpenAIBaseModel):
    """The structured-output fields of chat and completion requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("guided_decoding_backend")
    @classmethod
    def _backend(cls, v):
        if v is not None and v not in ("auto", "xgrammar"):
            raise ValueError(f"only the xgrammar backend is available, got {v!r}")
        return v

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _whitespace_pattern(cls, v):
        if v is not None:
            raise ValueError("guided_whitespace_pattern is not supported (xgrammar); "
                             "structured_outputs.disable_any_whitespace turns whitespace off")
        return v

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """(request field, StructuredOutputsParams constraint) for every field that sets one."""
        found = []
        if self.structured_outputs is not None and self.structured_outputs.constraint():
            found.append(("structured_outputs", self.structured_outputs.constraint()))
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            found.append(("response_format", {"json": rf.json_schema.json_schema}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        return found

    @property
    def wants_structured_output(self) -> bool:
        return bool(self._constraints())

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint (None without one), its grammar checked: parsing a schema can
        take a while, so servers call this off their event loop. Raises StructuredOutputError
        (a ValueError naming the field) when several fields set a constraint or it is bad."""
        found = self._constraints()
        if not found:
            return None
        if len(found) > 1:
            raise StructuredOutputError(
                f"only one output constraint may be given, got "
                f"{' and '.join(name for name, _ in found)}", found[1][0])
        name, constraint = found[0]
        param = _CONSTRAINT_PARAMS.get(name, name)
        field = param
        if name == "structured_outputs":
            field = f"structured_outputs.{next(iter(constraint))}"
        elif name == "response_format" and "json" in constraint:
            field = "response_format.json_schema.schema"
        if isinstance(constraint.get("json"), bool):
            raise StructuredOutputError(f"{field}: a boolean JSON schema is not supported",
                                        param)
        options = self.structured_outputs
        ws = options.disable_any_whitespace if options is not None else False
        try:
            params = StructuredOutputsParams(**constraint, disable_any_whitespace=ws)
            validate_structured_outputs(params, field)
        except ValueError as e:
            raise StructuredOutputError(str(e), param) from None
        return params


class StructuredOutputError(ValueError):
    """A bad output constraint; `param` is the request field to name in the 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


_CONSTRAINT_PARAMS = {"tool_choice": "tools"}
"""The field to name when a constraint built from another one is bad (tool_choice's schema is
made of the tools' parameters)."""


def tool_call_schema(tools: list[ChatCompletionToolParam], tool_choice: Any,
                     parallel_tool_calls: bool | None) -> dict[str, Any]:
    """The JSON schema of the output under tool_choice (vLLM's semantics): "required" = a JSON
    array of {"name", "parameters"} objects, each matching one of the tools (at most one item
    without parallel tool calls); a named function = that function's parameters object.
    `$defs` of the tools' parameters move to the top of the array schema (their `$ref`s point
    there)."""
    def params_of(tool: ChatCompletionToolParam) -> dict[str, Any]:
        return tool.function.parameters or {"type": "object", "properties": {}}

    if isinstance(tool_choice, NamedToolChoice):
        return params_of(next(t for t in tools if t.function.name == tool_choice.function.name))
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = dict(params_of(tool))
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"tools: conflicting $defs entry {key!r}")
            defs[key] = value
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema

# --------------------------------------------------------------------- end structured outputs


class SamplingFields(VllmUnsupportedFields, StructuredOutputFields):
    """Fields shared by chat and completion requests (OpenAI + vLLM extensions)."""

    model: str | None = None
    n: int = Field(default=1, ge=1)
    """At most the server's max_n_sequences (checked by the serving class)."""
    best_of: int | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=_MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    """OpenAI: token id (as a string) -> bias in [-100, 100]."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    """vLLM extension: put prompt_token_ids and token_ids into the response."""
    cache_salt: str | None = Field(default=None, min_length=1)
    """vLLM extension: prefix-cache entries are shared only between requests with the same
    salt."""
    user: str | None = None
    """OpenAI's end-user id (for abuse monitoring elsewhere): accepted, no effect on output."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """vLLM: keep only this many prompt tokens (-1: max_model_len), the last ones unless
    truncation_side is "right"."""
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM: the id of the response (`<prefix>-<request_id>`)."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM: prefill/decode disaggregation, on a server with --kv-transfer-config.
    {"do_remote_decode": true} on a prefill instance (its response then carries the
    parameters a decode instance pulls the prompt's state with); that response's
    kv_transfer_params on the decode instance (kdaserve/disagg/params.py)."""

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 64:
            raise ValueError(f"at most 64 stop strings, got {len(items)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for key, val in (v or {}).items():
            k = key.strip()
            if not (k.isascii() and k.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= val <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {val} for "
                                 f"token {key}")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        # Reject what we cannot honour instead of ignoring it silently.
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of == n)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool = False
    """vLLM: the reply starts with the last message's content when that message has the
    reply's role (assistant)."""
    add_special_tokens: bool = False
    """vLLM: also add the tokenizer's special tokens (BOS) before the templated prompt."""
    documents: list[dict[str, Any]] | None = None
    """vLLM / HF: passed to the chat template (RAG documents)."""
    reasoning_effort: str | None = None
    """Passed to the chat template as `reasoning_effort`, as vLLM does."""
    include_reasoning: bool = True
    """vLLM: false leaves the reasoning out of the reply."""
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    @field_validator(*_CHAT_ONLY_UNSUPPORTED)
    @classmethod
    def _refuse_chat(cls, v, info):
        return refuse_unless_neutral(v, info.field_name)

    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        self._check_forced_tool_choice()
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true")
        return self

    # ---------------------------------------------------------------- structured outputs
    @property
    def forced_tool_choice(self) -> bool:
        """tool_choice "required" or a named function: the output is tool-call JSON."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def _check_forced_tool_choice(self) -> None:
        if not self.forced_tool_choice:
            return
        if not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names the function "
                                 f"{self.tool_choice.function.name!r}, which is not in tools "
                                 f"({', '.join(names)})")

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        found = super()._constraints()
        if self.forced_tool_choice:
            found.append(("tool_choice", {"json": tool_call_schema(
                self.tools, self.tool_choice, self.parallel_tool_calls)}))
        return found

    # ----------------------------------------------------------------------------------
    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """Takes precedence over max_tokens, as on /v1/chat/completions."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS) to text prompts (vLLM's default: true)."""

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if any(isinstance(p, list) and not p for p in v):
                raise ValueError("token-id prompts must not be empty")
            if any(t < 0 for p in v for t in (p if isinstance(p, list) else [p])
                   if isinstance(t, int)):
                raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default as vLLM: true for a prompt, false for messages (the template adds them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatCompletionToolParam] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        chat_only = sorted(self.model_fields_set & {
            "add_generation_prompt", "continue_final_message", "tools", "chat_template",
            "chat_template_kwargs"})
        if self.prompt is not None and chat_only:
            raise ValueError(f"{', '.join(chat_only)} apply to messages, not to a prompt")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage_dict(prompt_tokens: int, completion_tokens: int,
               cached_tokens: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def model_card(model_id: str, root: str, max_model_len: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": now(), "owned_by": "kdaserve",
            "root": root, "parent": None, "max_model_len": max_model_len, "permission": []}
