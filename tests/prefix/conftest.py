"""The tiny-model fixtures of the engine tests (make_llm checks every pool is free after)."""

from tests.engine.conftest import hf_model, make_llm, tiny_model_dir  # noqa: F401
