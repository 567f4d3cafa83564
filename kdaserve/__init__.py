"""kdaserve: a serving engine for hybrid KDA + MLA + MoE models (Kimi Linear / Kimi K3)."""

__version__ = "0.1.0"

from kdaserve.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch and the model; import it lazily so `import kdaserve` stays cheap.
    if name == "LLM":
        from kdaserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
