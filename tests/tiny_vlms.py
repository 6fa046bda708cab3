"""The tests' tiny random-weight image-text-to-text checkpoints: the ``test`` size preset of
``rlvla3.policy.presets`` (LLaVA and Idefics3 / SmolVLM), written to a temp dir."""

from __future__ import annotations

from pathlib import Path

from rlvla3.policy.presets import FAMILIES, IMAGE_SIZE, VOCAB_SIZE, byte_tokenizer, llama_config
from rlvla3.policy.presets import write_vlm as _write_vlm

__all__ = ["FAMILIES", "IMAGE_SIZE", "VOCAB_SIZE", "byte_tokenizer", "write_tiny_vlm"]


def _llama(vocab_size: int):
    """The test preset's Llama text model (a text-only model the loader must refuse)."""
    return llama_config(vocab_size)


def write_tiny_vlm(
    directory: Path, family: str, *, vocab_size: int = VOCAB_SIZE, seed: int = 0
) -> Path:
    """Save a ``test``-size random-weight ``family`` model and its processor into ``directory``."""
    return _write_vlm(directory, family, "test", vocab_size=vocab_size, seed=seed)
