"""Byte-level instruction tokenizer: no vocabulary file, no download, any language.

A token is a UTF-8 byte plus one, so ``0`` is free to mean padding: ``VOCAB_SIZE = 256 + 1``.
Instructions are right-padded with zeros to a fixed length; env workers put these ``int32`` arrays
on the wire as ``obs["instruction"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

PAD_ID = 0
VOCAB_SIZE = 257
SPACE_ID = ord(" ") + 1  # the id of the space byte
InstructionTokens = Literal["bytes", "words"]


def encode_instruction(text: str, max_len: int) -> np.ndarray:
    """Encode ``text`` as int32[max_len]: UTF-8 bytes + 1, right-padded with ``PAD_ID``.

    Text longer than ``max_len`` bytes is truncated at a character boundary, so a multi-byte
    character is never cut in half.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    data = text.encode("utf-8")
    if len(data) > max_len:
        data = data[:max_len].decode("utf-8", errors="ignore").encode("utf-8")
    out = np.zeros(max_len, dtype=np.int32)
    out[: len(data)] = np.frombuffer(data, dtype=np.uint8).astype(np.int32) + 1
    return out


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


def instruction_token_counts(instructions: np.ndarray, mode: InstructionTokens) -> np.ndarray:
    """Transformer tokens of each instruction int[N, L] under ``mode``: int64[N].

    ``bytes``: one per real byte; ``words``: one per space-separated word (what the VLA's
    instruction encoder makes of them, rlvla3/policy/instruction.py; the SFT packer budgets with
    these counts).
    """
    instr = np.asarray(instructions)
    is_char = instr != PAD_ID
    if mode == "bytes":
        return is_char.sum(1).astype(np.int64)
    is_char &= instr != SPACE_ID
    before = np.pad(is_char[:, :-1], ((0, 0), (1, 0)))
    return (is_char & ~before).sum(1).astype(np.int64)
