"""The bundled default model: a small Llama trained on public-domain Shakespeare and Milton.

`DEFAULT_MODEL_DIR` is a standard Hugging Face folder (config, generation config, safetensors weights,
fast tokenizer with a chat template) shipped inside the installed package, so cellserve can load a model
with no network. It is produced only by `python -m engine.loader.default.train`.
"""

from pathlib import Path

DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "model"
HELDOUT_TEXT_PATH: Path = Path(__file__).resolve().parent / "data" / "heldout.txt"

__all__ = ["DEFAULT_MODEL_DIR", "HELDOUT_TEXT_PATH"]
