"""kv_transfer_params: what the proxy hands from a prefill instance's response to a decode
instance's request (vLLM's field of that name), and its check.

Prefill request:   {"do_remote_decode": true}   (with max_tokens = 1)
Prefill response:  {"do_remote_prefill": true, "remote_engine_id": ..., "remote_host": ...,
                    "remote_ports": [side-channel port per TP rank], "remote_tp_size": ...,
                    "remote_request_id": ..., "remote_block_ids": [...],
                    "remote_state_slot": ..., "num_prompt_tokens": P, "prompt_hash": ...,
                    "first_token_id": t0, "expires_in_s": hold}
Decode request:    the prefill response's object, unchanged.

The decode instance checks that its own tokenization of the prompt has P tokens with the same
hash, appends t0 as the first output token, pulls the P tokens' KV blocks and the KDA state
after them, and continues decoding from t0.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


def prompt_hash(token_ids: list[int]) -> str:
    """A short digest of a prompt's token ids (both sides must have tokenized alike)."""
    h = hashlib.sha256(b",".join(str(t).encode() for t in token_ids))
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class RemoteRef:
    """Where a held request lives: enough to pull it or release it."""

    engine_id: str
    host: str
    ports: tuple[int, ...]
    """Side-channel port of each TP rank of the producer."""
    request_id: str


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request's parsed kv_transfer_params."""

    ref: RemoteRef
    tp_size: int
    block_ids: tuple[int, ...]
    state_slot: int
    num_prompt_tokens: int
    prompt_hash: str
    first_token_id: int
    expires_in_s: float

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "RemotePrefill":
        """ValueError naming the first missing or malformed field."""
        def get(key: str, kind: type | tuple[type, ...]) -> Any:
            v = params.get(key)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ValueError(f"kv_transfer_params {key!r} is missing or not a "
                                 f"{getattr(kind, '__name__', kind)}: {v!r}")
            return v

        def ints(key: str) -> tuple[int, ...]:
            v = get(key, list)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
                raise ValueError(f"kv_transfer_params {key!r} must be a list of ints >= 0")
            return tuple(v)

        ports = ints("remote_ports")
        tp_size = get("remote_tp_size", int)
        if tp_size < 1 or len(ports) != tp_size:
            raise ValueError(f"kv_transfer_params: {len(ports)} remote_ports for "
                             f"remote_tp_size={tp_size}")
        ref = RemoteRef(get("remote_engine_id", str), get("remote_host", str), ports,
                        get("remote_request_id", str))
        remote = cls(ref, tp_size, ints("remote_block_ids"), get("remote_state_slot", int),
                     get("num_prompt_tokens", int), get("prompt_hash", str),
                     get("first_token_id", int), float(get("expires_in_s", (int, float))))
        if remote.num_prompt_tokens < 1 or remote.first_token_id < 0 or remote.state_slot < 0:
            raise ValueError("kv_transfer_params: num_prompt_tokens, first_token_id and "
                             "remote_state_slot must be >= 1, >= 0, >= 0")
        return remote

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.ref.engine_id, "remote_host": self.ref.host,
                "remote_ports": list(self.ref.ports), "remote_tp_size": self.tp_size,
                "remote_request_id": self.ref.request_id,
                "remote_block_ids": list(self.block_ids), "remote_state_slot": self.state_slot,
                "num_prompt_tokens": self.num_prompt_tokens, "prompt_hash": self.prompt_hash,
                "first_token_id": self.first_token_id, "expires_in_s": self.expires_in_s}
