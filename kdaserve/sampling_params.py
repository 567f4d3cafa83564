"""SamplingParams with vLLM's field names and validation; StructuredOutputsParams, the
constraint a request's output must follow (vLLM's `structured_outputs`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

_MAX_LOGPROBS = 20

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on the whole output (vLLM's names): `json` a JSON schema (a dict
    or its JSON text), `regex` a pattern the output must match in full, `choice` one of these
    strings, `grammar` an EBNF grammar (GBNF style, `root ::= ...`; Lark syntax when it has no
    `::=`), `json_object` any JSON object. disable_any_whitespace: JSON without whitespace
    between tokens (else any amount may appear, as in vLLM).

    Only the shape is checked here; whether the schema / pattern / grammar parses is checked
    by kdaserve.structured_output.validate_structured_outputs (it needs the grammar library)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            kinds = ", ".join(STRUCTURED_OUTPUT_KINDS)
            raise ValueError(f"structured_outputs needs exactly one of {kinds}, "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its "
                             f"JSON text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @property
    def kind(self) -> str:
        """Which constraint: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 or 0 = no top-k."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (OpenAI's meaning)."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence of the token in the output so far."""
    repetition_penalty: float = 1.0
    """Tokens seen in the prompt or the output: positive logits divided by it, negative ones
    multiplied (HF / vLLM convention; 1 = off)."""
    logit_bias: dict[int, float] | None = None
    """token id -> value added to its logit before sampling (values in [-100, 100])."""
    seed: int | None = None
    max_tokens: int | None = 16
    """None = up to max_model_len."""
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    """Number of top logprobs per output token (the sampled token's logprob is always included)."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    max_logprobs: int = field(default=_MAX_LOGPROBS, repr=False)
    structured_outputs: StructuredOutputsParams | None = None
    """The output must follow this constraint (grammar-masked sampling); None = free text."""

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):   # from the wire (dataclasses.asdict)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0.0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (disable), 0 (disable) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and (self.logprobs < 0 or self.logprobs > self.max_logprobs):
            bad("logprobs", f"must be in [0, {self.max_logprobs}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0")
        for tok, val in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                bad("logit_bias", f"keys must be token ids >= 0 (key {tok!r})")
            if not -100.0 <= val <= 100.0:
                bad("logit_bias", f"values must be in [-100, 100] (token {tok}: {val})")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be StructuredOutputsParams")

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Penalties or logit_bias: the logits depend on the request's history (such requests
        are not speculated)."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
