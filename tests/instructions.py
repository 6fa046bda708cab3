"""Test helpers for ``sim.tokenizer``: a batch encoder and the decoder (the inverse of
``encode_instruction``), used to check what envs put on the wire."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sim.tokenizer import PAD_ID, VOCAB_SIZE, encode_instruction


def encode_instructions(texts: Sequence[str], max_len: int) -> np.ndarray:
    """Encode a batch of instructions as int32[len(texts), max_len] (see ``encode_instruction``)."""
    out = np.zeros((len(texts), max_len), dtype=np.int32)
    for i, text in enumerate(texts):
        out[i] = encode_instruction(text, max_len)
    return out


def decode_instruction(tokens: Sequence[int] | np.ndarray) -> str:
    """Decode int tokens[L] back to text; ``PAD_ID`` tokens are skipped wherever they are.

    Accepts numpy arrays, lists and CPU torch tensors. Bytes that are not valid UTF-8 decode to
    U+FFFD. Raises ValueError for tokens outside ``[0, VOCAB_SIZE)``.
    """
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"tokens must lie in [0, {VOCAB_SIZE}), got {arr.min()}..{arr.max()}")
    data = (arr[arr != PAD_ID] - 1).astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")
