"""LLMEngine: the engine in one process, for the offline `LLM`: an EngineCore (scheduler + model
runner, token level) and an OutputProcessor (text, stop strings, RequestOutputs)."""

from __future__ import annotations

from kdaserve.config import EngineConfig
from kdaserve.core.engine_output import SchedulerStats
from kdaserve.engine.arg_utils import config_from_kwargs
from kdaserve.engine.core import EngineCore, config_eos_token_ids
from kdaserve.engine.output_processor import OutputProcessor, eos_token_ids
from kdaserve.models.tokenizer import get_tokenizer
from kdaserve.outputs import RequestOutput
from kdaserve.request import Request
from kdaserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine_config = config
        mc = config.model_config
        self.tokenizer = get_tokenizer(mc.tokenizer, mc.trust_remote_code)
        self.eos_token_ids = eos_token_ids(config_eos_token_ids(config), self.tokenizer)
        self.vocab_size = mc.arch.vocab_size
        self.engine_core = EngineCore(config)
        self.output_processor = OutputProcessor(self.tokenizer, self.vocab_size,
                                                mc.max_model_len, config.max_logprobs)

    @classmethod
    def from_engine_args(cls, **kwargs) -> "LLMEngine":
        return cls(config_from_kwargs(kwargs))

    # The core's parts, for tests and benchmarks that look inside.
    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def model_runner(self):
        return self.engine_core.model_runner

    @property
    def step_floor(self):
        return self.engine_core.step_floor

    # -----------------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """EngineCore.reset_prefix_cache."""
        return self.engine_core.reset_prefix_cache()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None,
                    prompt: str | None = None, cache_salt: str | None = None) -> None:
        self.output_processor.add_request(request_id, prompt, prompt_token_ids,
                                          sampling_params, arrival_time)
        try:
            self.engine_core.add_request(Request(
                request_id, prompt_token_ids, sampling_params, eos_token_ids=self.eos_token_ids,
                arrival_time=arrival_time, cache_salt=cache_salt))
        except Exception:
            self.output_processor.reject_request(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (self.engine_core.has_unfinished_requests()
                or self.output_processor.has_unfinished_requests())

    def step(self) -> list[RequestOutput]:
        """One engine step (EngineCore.step); cumulative outputs of the requests it advanced.
        Samples that a stop string ended are finished in the core before its next schedule."""
        processed = self.output_processor.process_outputs(self.engine_core.step())
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort, stopped=True)
        return processed.request_outputs

    def get_stats(self) -> SchedulerStats:
        stats = self.engine_core.get_stats()
        stats.num_prompt_tokens = self.output_processor.num_prompt_tokens
        stats.num_generation_tokens = self.output_processor.num_generation_tokens
        return stats

    @property
    def spec_decoding_stats(self):
        """SpecDecodingStats since start-up (None without speculative decoding)."""
        return self.engine_core.spec_decoding_stats
