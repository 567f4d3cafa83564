"""Engine test fixtures: a tiny transformers-saved KimiLinear model folder with a tokenizer, and
a check that every engine a test made ends with all KV blocks and state slots free."""

from __future__ import annotations

import pytest

from tests.models.hf_tiny import make_hf_model


def _write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20,
                            trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(path)


def target_and_spec(tmp_path, spec: str | None, **spec_config) -> tuple[str, dict]:
    """A tiny target folder and the engine kwargs of its drafter: spec None = the HF-saved
    model with a tokenizer and no drafter; "dspark" = the tiny preset with a random DSpark
    drafter (num_speculative_tokens 4 and spec_config)."""
    from kdaserve.models.make_model import make_dspark_model, make_model

    if spec is None:
        target = str(tmp_path / "model")
        make_hf_model(seed=0).save_pretrained(target)
        _write_tokenizer(target)
        return target, {}
    target = make_model(str(tmp_path / "target"), "tiny")
    return target, {"speculative_config": {
        "method": "dspark", "model": make_dspark_model(target, str(tmp_path / "dspark")),
        "num_speculative_tokens": 4, **spec_config}}


@pytest.fixture(scope="session")
def hf_model():
    return make_hf_model(seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, hf_model):
    path = str(tmp_path_factory.mktemp("tiny_kimi"))
    hf_model.save_pretrained(path)
    _write_tokenizer(path)
    return path


def llm_factory(model_dir: str, after=None):
    """A fixture body: yields make(**kwargs) -> LLM on model_dir (the tests' small cache and
    budget unless given); when the test ends, every pool of each LLM must be free, and
    after(llm) runs on each too."""
    from kdaserve import LLM

    made = []

    def make(**kwargs):
        kwargs.setdefault("max_model_len", 512)
        kwargs.setdefault("num_gpu_blocks", 256)
        kwargs.setdefault("max_num_batched_tokens", 512)
        llm = LLM(model_dir, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_pools_free(llm.llm_engine)
        if after is not None:
            after(llm)


def assert_drafter_free(llm) -> None:
    """A hidden-conditioned drafter (MTP, DSpark) holds no request state or KV block."""
    eng = llm.llm_engine
    if eng.model_runner.spec is None:
        return
    if eng.scheduler.has_finished_requests():   # the last finished ids reach the worker
        eng.step()
    drafter = eng.model_runner.spec.proposer
    assert not drafter.requests, f"{drafter.label} drafter state leaked"
    assert drafter.num_free_blocks == drafter.num_blocks, f"{drafter.label} KV blocks leaked"


@pytest.fixture
def make_llm(tiny_model_dir):
    """Factory for LLMs on the tiny model; after the test every pool must be all-free."""
    yield from llm_factory(tiny_model_dir)


def assert_pools_free(engine) -> None:
    sched = engine.scheduler
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_gpu_blocks, "KV blocks leaked"
    assert kv.num_free_slots == kv.num_state_slots, "KDA state slots leaked"
