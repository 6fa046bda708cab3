"""The tensor shapes of a saved ``transformers`` model, read without loading its weights.

The memory check at setup (``rlvla3/policy/memory_check.py``) needs a model's size before the
model is loaded: loading a model that cannot fit is what it is there to prevent. A safetensors
file starts with a little-endian u64 header length and a JSON header naming every tensor's dtype
and shape, so a few kB per file give the exact parameter count of any size of model. A directory
without safetensors files falls back to the model built from its ``config.json`` on torch's
meta device (shapes, no storage).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HEADER_LIMIT = 100 * 2**20  # a header longer than this is no safetensors header
_OUTPUT_EMBEDDING = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class SavedModelShapes:
    """What a saved model directory says about its size.

    Attributes:
        shapes: tensor name -> shape, as saved (names may differ from the module names
            ``transformers`` gives them at load; their endings, ``q_proj.weight``, do not).
        hidden_size: the text model's hidden size (0 when the config does not say).
    """

    shapes: dict[str, tuple[int, ...]]
    hidden_size: int

    @property
    def parameters(self) -> int:
        """Values in every tensor."""
        return sum(_numel(shape) for shape in self.shapes.values())


def saved_model_shapes(directory: Path) -> SavedModelShapes | None:
    """The shapes of the model saved in ``directory``, with the output embedding as a tensor
    of its own when the checkpoint ties it to the input embedding (the loader unties it:
    ``rlvla3/policy/hf_model.py``). None when neither the weights' headers nor the config
    tell (a broken directory: loading it reports what is wrong)."""
    config = _read_json(directory / "config.json") or {}
    text = config.get("text_config") or config
    try:
        shapes = _safetensors_shapes(directory) or _meta_model_shapes(directory)
    # ImportError: no transformers to build it with (loading it then says which extra)
    except (OSError, ValueError, KeyError, TypeError, struct.error, ImportError):
        return None
    if not shapes:
        return None
    hidden = int(text.get("hidden_size") or config.get("hidden_size") or 0)
    vocab = int(text.get("vocab_size") or config.get("vocab_size") or 0)
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
    if tied and hidden and vocab and not any(n.endswith(_OUTPUT_EMBEDDING) for n in shapes):
        shapes[_OUTPUT_EMBEDDING] = (vocab, hidden)
    return SavedModelShapes(shapes=shapes, hidden_size=hidden)


def _safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Shapes from the headers of the checkpoint's safetensors files: those the shard index
    names, else ``model.safetensors``, else every ``*.safetensors`` file (empty: none)."""
    index = _read_json(directory / "model.safetensors.index.json")
    if index is not None:
        files = sorted({directory / name for name in index["weight_map"].values()})
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        files = sorted(directory.glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for name, entry in _safetensors_header(file).items():
            if name != "__metadata__":
                shapes[name] = tuple(int(d) for d in entry["shape"])
    return shapes


def _safetensors_header(file: Path) -> dict[str, Any]:
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _HEADER_LIMIT:
            raise ValueError(f"{file}: not a safetensors file")
        return json.loads(f.read(length))


def _meta_model_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Shapes of the model its config describes, built on the meta device (no storage)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
