# SPDX-License-Identifier: Apache-2.0
"""`kdaserve serve [MODEL]`: vLLM's flag names and meanings, then the server's main loop.

Engine flags (shared with `kdaserve generate`) map 1:1 onto LLMEngine.from_engine_args kwargs;
a flag left unset is not passed, so the engine's own default applies. The optimisation switches
(whose "off" is a plain baseline, kept for ablation), the dummy loader's routing and the
kdaserve-only knobs of the server are keys of three JSON options, --optimization-config,
--model-loader-extra-config and --additional-config (vLLM groups such knobs as JSON options
too), so that --help lists what a user tunes; docs/configuration.md documents every option and
key.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kdaserve.entrypoints.openai.reasoning_parser import reasoning_parser_names
from kdaserve.entrypoints.openai.tool_parser import tool_parser_names

logger = logging.getLogger("kdaserve.serve")

DEFAULT_MODEL_DIRNAME = "tiny-kimi-linear"


def human_int(value: str) -> int | None:
    """vLLM's --max-model-len syntax: 4096, 32k (x1000), 32K (x1024), 1m / 1M, -1 or auto."""
    v = value.strip()
    if v in ("auto", "-1"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", v)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"invalid length {value!r}: use an integer, 32k / 32K style, or auto")
    number, suffix = m.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9,
             "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    if "." in number and suffix not in ("k", "m", "g"):
        raise argparse.ArgumentTypeError(
            f"invalid length {value!r}: decimals only with a lowercase (decimal) suffix")
    result = int(float(number) * scale)
    if result < 1:
        raise argparse.ArgumentTypeError(f"length must be >= 1, got {value!r}")
    return result


def json_dict(value: str) -> dict[str, Any]:
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from e
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return data


def kv_transfer_config(value: str) -> dict[str, Any]:
    """argparse type of --kv-transfer-config: a JSON object that KVTransferConfig accepts."""
    from kdaserve.config import KVTransferConfig

    data = json_dict(value)
    try:
        KVTransferConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return data


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from e
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from e
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return x


DOCS = "docs/configuration.md"
"""Where every option and every key of the JSON options is documented."""


@dataclass(frozen=True)
class KeyType:
    """The JSON value a config key takes: its name as documented, and its check."""

    name: str
    check: Callable[[Any], bool]


BOOL = KeyType("bool", lambda v: isinstance(v, bool))
POSITIVE_INT = KeyType("int >= 1",
                       lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)
NON_NEGATIVE_INT = KeyType("int >= 0",
                           lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


POSITIVE_FLOAT = KeyType("float > 0", lambda v: _number(v) and v > 0)
NON_NEGATIVE_FLOAT = KeyType("float >= 0", lambda v: _number(v) and v >= 0)
STRING = KeyType("string", lambda v: isinstance(v, str) and v != "")
STRING_LIST = KeyType("list of strings", lambda v: isinstance(v, list) and all(
    isinstance(s, str) and s for s in v))


def one_of(*values: str) -> KeyType:
    return KeyType(" | ".join(f'"{v}"' for v in values),
                   lambda v: isinstance(v, str) and v in values)


OPTIMIZATION_CONFIG_KEYS: dict[str, KeyType] = {
    "decode_gemv": BOOL,
    "pdl": BOOL,
    "skinny_gemm": BOOL,
    "fused_kda_decode": BOOL,
    "kda_state_prefetch": BOOL,
    "mla_absorb_gemv": BOOL,
    "dense_mlp_gemv": BOOL,
    "sampling_threshold_kernel": BOOL,
    "latent_moe_fused_tail": BOOL,
    "k3_fused_ops": BOOL,
    "mla_verify_fold": BOOL,
    "moe_tma_weights": BOOL,
    "sampling_race_kernel": BOOL,
    "router_partials": BOOL,
    "kda_checkpoint_mode": one_of("internal", "split"),
    "kda_checkpoint_interval": POSITIVE_INT,
    "num_kda_checkpoint_slots": NON_NEGATIVE_INT,
    "kda_checkpoint_turn_end": BOOL,
    "adaptive_spec_budget": BOOL,
}
"""--optimization-config keys -> value type (what each does: DOCS and the config dataclasses).
Each key is the engine kwarg of the same name (LLMEngine.from_engine_args routes it to its
config dataclass); a key left out keeps the engine's default, and every default is the
optimised path."""

MODEL_LOADER_EXTRA_CONFIG_KEYS: dict[str, KeyType] = {"dummy_routing": one_of("vllm", "spread")}
"""--model-loader-extra-config keys -> value type; each is an engine kwarg."""

ADDITIONAL_CONFIG_KEYS: dict[str, KeyType] = {
    "num_state_slots": POSITIVE_INT,
    "dist_timeout": POSITIVE_INT,
    "dcp_kv_cache_interleave_size": POSITIVE_INT,
    "kv_offload_disk_path": STRING,
    "kv_offload_disk_size": POSITIVE_FLOAT,
    "compile_workers": NON_NEGATIVE_INT,
    "mirror_reasoning_content": BOOL,
    "max_request_body_bytes": POSITIVE_INT,
    "engine_startup_timeout": POSITIVE_FLOAT,
    "max_n_sequences": POSITIVE_INT,
    "max_completion_prompts": POSITIVE_INT,
    "request_chat_template_timeout": POSITIVE_FLOAT,
    "allowed_hosts": STRING_LIST,
    "graceful_shutdown_timeout": NON_NEGATIVE_FLOAT,
    "stream_buffer_limit": POSITIVE_INT,
}
"""--additional-config keys -> value type: the kdaserve-only knobs (vLLM's option of that name
holds platform-specific ones). ENGINE_ADDITIONAL_KEYS are engine kwargs; the others are read
by the server from args.additional_config, which holds every key (ADDITIONAL_CONFIG_DEFAULTS
for those not given)."""

ENGINE_ADDITIONAL_KEYS = ("num_state_slots", "dist_timeout", "dcp_kv_cache_interleave_size",
                          "kv_offload_disk_path", "kv_offload_disk_size", "compile_workers")

ADDITIONAL_CONFIG_DEFAULTS: dict[str, Any] = {
    "mirror_reasoning_content": True,
    "max_request_body_bytes": 16 * 1024 * 1024,
    "engine_startup_timeout": 900.0,
    "max_n_sequences": 256,
    "max_completion_prompts": 256,
    "request_chat_template_timeout": 5.0,
    "allowed_hosts": None,
    "graceful_shutdown_timeout": 10.0,
    "stream_buffer_limit": 64,
}
"""Server-side defaults (the engine keys have none: the engine sizes them). allowed_hosts None:
only loopback names in the Host header when --host is a loopback address, any host otherwise."""


def keyed_json(value: str, keys: dict[str, KeyType]) -> dict[str, Any]:
    """A JSON object whose every key is in `keys` with a value of that key's type."""
    data = json_dict(value)
    for key, v in data.items():
        if key not in keys:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r}; valid keys: {', '.join(keys)} (see {DOCS})")
        kind = keys[key]
        if not kind.check(v):
            raise argparse.ArgumentTypeError(f"{key!r} must be {kind.name}, got {json.dumps(v)}")
    return data


def optimization_config(value: str) -> dict[str, Any]:
    """argparse type of --optimization-config (OPTIMIZATION_CONFIG_KEYS)."""
    return keyed_json(value, OPTIMIZATION_CONFIG_KEYS)


def model_loader_extra_config(value: str) -> dict[str, Any]:
    """argparse type of --model-loader-extra-config (MODEL_LOADER_EXTRA_CONFIG_KEYS)."""
    return keyed_json(value, MODEL_LOADER_EXTRA_CONFIG_KEYS)


def additional_config(value: str) -> dict[str, Any]:
    """argparse type of `kdaserve serve --additional-config` (ADDITIONAL_CONFIG_KEYS): every
    key, the defaults filling those not given."""
    return ADDITIONAL_CONFIG_DEFAULTS | keyed_json(value, ADDITIONAL_CONFIG_KEYS)


def engine_additional_config(value: str) -> dict[str, Any]:
    """argparse type of `kdaserve generate --additional-config`: the engine keys only."""
    return keyed_json(value, {k: ADDITIONAL_CONFIG_KEYS[k] for k in ENGINE_ADDITIONAL_KEYS})


def add_engine_args(p: argparse.ArgumentParser, server: bool = False) -> None:
    """The engine options; server=True: --additional-config takes the server's keys too."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", dest="model_flag", default=None,
                   help="Model folder (same as the positional MODEL).")
    g.add_argument("--tokenizer", default=None, help="Tokenizer folder (default: the model).")
    g.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "float32",
                                                     "half", "float", "bf16"],
                   help="Weight/activation dtype; auto = bf16 on CUDA, fp32 on the CPU.")
    g.add_argument("--seed", type=int, default=None, help="Engine seed.")
    g.add_argument("--max-model-len", type=human_int, default=None,
                   help="Context length: 4096, 32k, 32K or auto (the model's limit).")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="Most requests in one batch.")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="Token budget of one engine step.")
    g.add_argument("--block-size", type=positive_int, default=None,
                   help="Tokens per MLA KV block.")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="Fraction of GPU memory the engine may use (0, 1].")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="Never capture CUDA graphs.")
    g.add_argument("--load-format", default=None,
                   choices=["auto", "safetensors", "fastsafetensors", "dummy"],
                   help="dummy = random weights (no checkpoint read); fastsafetensors = read "
                        "through that library (safetensors where it is not installed).")
    g.add_argument("--quantization", "-q", default=None, choices=["mxfp4"],
                   help="mxfp4 = routed experts in MXFP4 (bf16 experts quantised at load); "
                        "default: as the checkpoint's quantization_config says.")
    g.add_argument("--model-loader-extra-config", type=model_loader_extra_config, default=None,
                   metavar="JSON",
                   help="JSON object of loader options, e.g. '{\"dummy_routing\": \"spread\"}'. "
                        "Keys: " + ", ".join(MODEL_LOADER_EXTRA_CONFIG_KEYS) + " (" + DOCS
                        + ").")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=None,
                   help="Tensor-parallel ranks (one process each; gloo on the CPU, NCCL on "
                        "CUDA).")
    g.add_argument("--decode-context-parallel-size", "-dcp", type=positive_int, default=None,
                   help="Decode context parallelism: MLA's latent KV sharded along the sequence "
                        "over this many consecutive tensor-parallel ranks (divides "
                        "--tensor-parallel-size); each stores 1/dcp of every context, so the "
                        "KV capacity grows dcp times. Not with speculative decoding.")
    g.add_argument("--nnodes", type=positive_int, default=None,
                   help="Nodes the ranks are spread over (equal shares, node by node).")
    g.add_argument("--node-rank", type=int, default=None,
                   help="This node's index (0: the API server, scheduler and ranks 0..; the "
                        "others run with --headless and only host ranks).")
    g.add_argument("--master-addr", default=None,
                   help="Node 0's address for torch.distributed's rendezvous (default: "
                        "127.0.0.1).")
    g.add_argument("--master-port", type=int, default=None,
                   help="Its port (default on one node: a free one; several nodes: required).")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="Reuse KV blocks and KDA state of shared prefixes.")
    g.add_argument("--kv-offload-size", "--kv-offloading-size", type=non_negative_float,
                   default=None, metavar="GIB",
                   help="GiB of host memory (over all ranks) that evicted MLA blocks and KDA "
                        "checkpoints of the prefix cache spill to (0: none); a disk level "
                        "under it: the kv_offload_disk_path key (" + DOCS + ").")
    g.add_argument("--speculative-config", "-sc", type=json_dict, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(keys: " + DOCS + ").")
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None,
                   help="Exact number of MLA KV blocks (skips memory profiling).")
    g.add_argument("--device", default=None, choices=["auto", "cuda", "cpu"],
                   help="auto = cuda when available, else cpu.")
    g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="Most tokens one prefill may take per step (0 = only the budget).")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="Schedule and launch the next step before the last one's sampled ids "
                        "reach the host (default on; speculative decoding and penalties run "
                        "one step at a time).")
    g.add_argument("--optimization-config", type=optimization_config, default=None,
                   metavar="JSON",
                   help="JSON object of optimisation switches, each off = that optimisation's "
                        "plain baseline (for ablation), e.g. '{\"decode_gemv\": false, "
                        "\"kda_checkpoint_mode\": \"split\"}'. Keys: "
                        + ", ".join(OPTIMIZATION_CONFIG_KEYS) + " (types, defaults and "
                        "baselines: " + DOCS + ").")
    if server:
        g.add_argument("--kv-transfer-config", type=kv_transfer_config, default=None,
                       metavar="JSON",
                       help="Prefill/decode disaggregation (vLLM's flag), e.g. "
                            "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": "
                            "\"kv_producer\"}'; roles kv_producer | kv_consumer | kv_both; "
                            "keys and kv_connector_extra_config: " + DOCS + ".")
    keys = ADDITIONAL_CONFIG_KEYS if server else ENGINE_ADDITIONAL_KEYS
    g.add_argument("--additional-config", type=additional_config if server
                   else engine_additional_config, default="{}", metavar="JSON",
                   help="JSON object of kdaserve-only knobs, e.g. '{\"num_state_slots\": 64}'. "
                        "Keys: " + ", ".join(keys) + " (" + DOCS + ").")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Accepted for vLLM compatibility; no remote code is ever run.")


_ENGINE_FLAGS = ("tokenizer", "dtype", "seed", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "block_size", "gpu_memory_utilization",
                 "enforce_eager", "load_format", "quantization", "tensor_parallel_size",
                 "decode_context_parallel_size",
                 "nnodes", "node_rank", "master_addr", "master_port",
                 "enable_prefix_caching", "kv_offload_size",
                 "speculative_config", "num_gpu_blocks_override", "device",
                 "async_scheduling", "long_prefill_token_threshold", "kv_transfer_config")
"""Flag dests passed on as the engine kwarg of the same name (or its _RENAMED one). The keys of
--optimization-config and --model-loader-extra-config, and ENGINE_ADDITIONAL_KEYS of
--additional-config, are engine kwargs themselves."""
_RENAMED = {"num_gpu_blocks_override": "num_gpu_blocks"}


def resolve_model(args: argparse.Namespace) -> str:
    """The model folder to load: MODEL or --model (a ValueError if they differ or the folder is
    missing), else the embedded default."""
    positional = getattr(args, "model_tag", None)
    if positional and args.model_flag and positional != args.model_flag:
        raise ValueError(f"two different models given: {positional!r} and {args.model_flag!r}")
    model = positional or args.model_flag
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        raise ValueError(f"model folder {model!r} does not exist")
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is not a folder (config.json + weights + tokenizer)")
    return model


def engine_kwargs_from_args(args: argparse.Namespace, model: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"model": model}
    for attr in _ENGINE_FLAGS:
        value = getattr(args, attr, None)
        if value is not None:
            kwargs[_RENAMED.get(attr, attr)] = value
    for option in ("optimization_config", "model_loader_extra_config"):
        kwargs |= getattr(args, option, None) or {}
    extra = getattr(args, "additional_config", None) or {}
    kwargs |= {k: extra[k] for k in ENGINE_ADDITIONAL_KEYS if extra.get(k) is not None}
    return kwargs


def served_model_names(args: argparse.Namespace, model: str) -> list[str]:
    """--served-model-name, else the model folder's name: the path itself is not shown to
    clients (/v1/models, /metrics labels), which may still send it as the model."""
    if args.served_model_name:
        return list(args.served_model_name)
    return [os.path.basename(os.path.normpath(model)) or model]


def default_model_path() -> str:
    """The embedded default: a tiny random model, made once and cached (works offline)."""
    cache = os.environ.get("KDASERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kdaserve")
    path = os.path.join(cache, DEFAULT_MODEL_DIRNAME)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from kdaserve.models.make_model import make_model

    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=cache)
    logger.info("making the default tiny model in %s", path)
    make_model(tmp, preset="tiny")
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve a model over an OpenAI-compatible HTTP API (vLLM's flags). "
                    "Without MODEL, serves an embedded tiny random model.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Model folder (config.json + weights + tokenizer).")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="Address to listen on (default: %(default)s, this machine only; "
                        "0.0.0.0 for every interface).")
    s.add_argument("--port", type=int, default=8000,
                   help="Port to listen on (default: %(default)s).")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) clients use; the first is reported (default: the name "
                        "of the MODEL folder).")
    s.add_argument("--api-key", default=None,
                   help="Require `Authorization: Bearer KEY` on every route but /health "
                        "(default: $KDASERVE_API_KEY, else $VLLM_API_KEY, else none).")
    s.add_argument("--chat-template", default=None,
                   help="Chat template file or inline Jinja (overrides the tokenizer's).")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="Accept a request's own `chat_template` (rendered in a sandbox process "
                        "with a time limit); without it such requests get HTTP 400.")
    s.add_argument("--reasoning-parser", default=None, choices=reasoning_parser_names(),
                   help="Split the reasoning out of chat outputs.")
    s.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                   help="Parse tool calls out of chat outputs.")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Let the model call tools (tool_choice=auto); needs --tool-call-parser.")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="Log level of the server and of kdaserve's logging (default: info).")
    s.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="No access log line per HTTP request.")
    s.add_argument("--headless", action="store_true",
                   help="A worker node (--node-rank > 0): host this node's tensor-parallel "
                        "ranks only, no API server; node 0's engine drives them.")
    add_engine_args(p, server=True)
    p.set_defaults(func=run_serve)
    return p


API_KEY_ENV = ("KDASERVE_API_KEY", "VLLM_API_KEY")
"""Where the API key is read from when --api-key is not given (first set wins): a key in the
environment is not visible in `ps` as a command-line argument is."""


def resolve_api_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        return args.api_key
    return next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)


def check_server_args(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")


def check_port_free(host: str, port: int) -> None:
    """Fail before the engine loads (minutes for a large model) if the address is taken."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from e
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def run_serve(args: argparse.Namespace) -> int:
    """Start-up failures print one line (exit code 2); their traceback goes to the log at
    debug level."""
    import asyncio

    logging.basicConfig(level=args.uvicorn_log_level.upper() if args.uvicorn_log_level != "trace"
                        else "DEBUG", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_server_args(args)
        if not args.headless:
            check_port_free(args.host, args.port)
        args.api_key = resolve_api_key(args)
        chat_template = load_chat_template(args.chat_template)
        model = resolve_model(args)
        if args.headless:
            from kdaserve.entrypoints.headless import run_headless

            return run_headless(engine_kwargs_from_args(args, model))
        from kdaserve.entrypoints.openai.server import serve

        return asyncio.run(serve(args, model, engine_kwargs_from_args(args, model),
                                 chat_template))
    except (ValueError, OSError) as e:
        logger.debug("start-up failed", exc_info=True)
        print(f"kdaserve serve: error: {e}", file=sys.stderr)
        return 2
