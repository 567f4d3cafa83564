"""The offline `LLM` API with vLLM's shapes."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.entrypoints.chat_utils import (UserTextGuard, added_token_texts, render_chat,
                                             template_kwargs)
from kdaserve.outputs import RequestOutput
from kdaserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """LLM(model=PATH, dtype="auto", max_model_len=..., max_num_seqs=..., ...).

    Any EngineConfig field may be passed by its vLLM name. Without CUDA it runs on the CPU in
    fp32.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        kwargs.setdefault("max_num_seqs", 256)
        self.llm_engine = LLMEngine.from_engine_args(model=model, **kwargs)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> int:
        return self.llm_engine.reset_prefix_cache()

    def _to_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.llm_engine.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._to_ids(prompt["prompt"])
        raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids', got "
                         f"{type(prompt).__name__}")

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, sp in zip(prompts, params):
                text, token_ids = self._to_ids(prompt)
                rid = str(next(self._counter))
                engine.add_request(rid, token_ids, sp, prompt=text)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in ids if r not in done])
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None
             ) -> list[RequestOutput]:
        """Each conversation through the chat template; text in the messages tokenizes as text
        even where it spells a control token (chat_utils.UserTextGuard)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.llm_engine.tokenizer
        token_texts = added_token_texts(tok)
        prompts = []
        for conv in conversations:
            guard = UserTextGuard(token_texts)
            pieces = guard.split(render_chat(
                tok, guard.protect(conv), tools=guard.protect(tools),
                kwargs=guard.protect(template_kwargs(chat_template_kwargs))))
            prompts.append({"prompt": "".join(pieces), "prompt_token_ids": [
                t for piece in pieces for t in tok.encode(piece, add_special_tokens=False)]})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
