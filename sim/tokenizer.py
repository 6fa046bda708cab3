"""Byte-level instruction tokenizer: no vocabulary file, no download, any language.

A token is a UTF-8 byte plus one, so ``0`` is free to mean padding: ``VOCAB_SIZE = 256 + 1``.
Instructions are right-padded with zeros to a fixed length; env workers put these ``int32`` arrays
on the wire as ``obs["instruction"]``.
"""

from __future__ import annotations

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
