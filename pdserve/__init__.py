"""pdserve: LLM serving that holds latency SLOs on one GPU and across a cluster."""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import pdserve.bench` or the server never pays for the engine import.
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from pdserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
