"""tokenmill: an LLM inference engine and OpenAI-compatible server."""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_LAZY = {"LLM": "tokenmill.entrypoints.llm", "LLMEngine": "tokenmill.engine.llm_engine",
         "SamplingParams": "tokenmill.sampling_params", "RequestOutput": "tokenmill.outputs",
         "CompletionOutput": "tokenmill.outputs"}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    """Import on first use, so light tools (the CLI's --help, the planner) start fast."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
