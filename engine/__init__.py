"""cellserve's engine, as a library: `from engine import LLM, SamplingParams, AsyncEngine, EngineArgs`.

The four names load on first use (PEP 562's module `__getattr__`), not when this package does: every
`import engine.api...` runs this file first, and the server's torch-free contract (engine.api) must not pull
in torch, transformers or the model code with it.
"""

__all__ = ["LLM", "AsyncEngine", "EngineArgs", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.core.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from engine.core.async_engine import AsyncEngine

        return AsyncEngine
    if name == "SamplingParams":
        from engine.api.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineArgs":
        from engine.api.args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'engine' has no attribute {name!r}; it exports {', '.join(__all__)}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
