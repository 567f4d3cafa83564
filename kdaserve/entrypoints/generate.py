# SPDX-License-Identifier: Apache-2.0
"""`kdaserve generate [MODEL] --prompt TEXT ...`: offline generation with kdaserve.LLM."""

from __future__ import annotations

import argparse
import json
import sys

from kdaserve.entrypoints.openai.cli_args import (add_engine_args, engine_kwargs_from_args,
                                                  positive_int, resolve_model)
from kdaserve.sampling_params import SamplingParams


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", help="Generate text offline (no server).",
        description="Generate completions for one or more prompts with kdaserve.LLM. Without "
                    "MODEL, uses the embedded tiny random model.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", "-p", action="append", required=True,
                   help="A prompt; repeat for a batch.")
    g.add_argument("--chat", action="store_true",
                   help="Wrap each prompt as a user message with the chat template.")
    g.add_argument("--max-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    g.add_argument("--n", type=positive_int, default=1)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--json", action="store_true", help="One JSON object per prompt on stdout.")
    add_engine_args(p)
    p.set_defaults(func=run_generate)
    return p


def build_sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
                          max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                          logprobs=args.logprobs)


def run_generate(args: argparse.Namespace) -> int:
    try:
        params = build_sampling_params(args)
        model = resolve_model(args)
        from kdaserve.entrypoints.llm import LLM

        kwargs = engine_kwargs_from_args(args, model)
        llm = LLM(kwargs.pop("model"), **kwargs)
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                               use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except ValueError as e:
        print(f"kdaserve generate: error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "prompt_tokens": len(out.prompt_token_ids),
                              "outputs": [{"index": c.index, "text": c.text,
                                           "token_ids": c.token_ids,
                                           "finish_reason": c.finish_reason}
                                          for c in out.outputs]}, ensure_ascii=False))
            continue
        for c in out.outputs:
            tag = f" [{c.index}]" if len(out.outputs) > 1 else ""
            print(f"--- prompt{tag}: {prompt!r} ({c.finish_reason}, {len(c.token_ids)} tokens)")
            print(c.text)
    return 0
