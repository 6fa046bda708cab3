"""The token VLA's prompts: the wire's observations (byte-token instruction, state vector) as the
text a pretrained model reads.

A prompt is ``policy.token_vla.prompt`` with ``{instruction}`` (the decoded instruction),
``{state}`` (`` State: 0.120 -0.500``, each value with ``state_decimals`` decimals; empty when no
state is mapped) and ``{image}`` (the model's image token, which its processor expands; in front
of the prompt when the template has no ``{image}``). Fixed decimals keep the text,
and so the tokens, of one state the same on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.tokenizer import PAD_ID


def decode_instruction(tokens: np.ndarray) -> str:
    """Byte tokens int[L] (UTF-8 bytes + 1, 0 = pad; sim/tokenizer.py) -> the text."""
    row = np.asarray(tokens).astype(np.int64)
    data = bytes((row[row != PAD_ID] - 1).clip(0, 255).astype(np.uint8).tolist())
    return data.decode("utf-8", errors="replace")


def state_text(state: np.ndarray | None, decimals: int) -> str:
    """``" State: v0 v1 ..."`` with fixed decimals, or ``""`` without a state."""
    if state is None:
        return ""
    values = " ".join(f"{float(v):.{decimals}f}" for v in np.asarray(state).reshape(-1))
    return f" State: {values}"


@dataclass(frozen=True, slots=True)
class PromptBuilder:
    """Builds one prompt per observation row.

    Attributes:
        template: the configured prompt with ``{instruction}``, ``{state}`` and ``{image}``
            (``{image}`` put in front, once, when it has none).
        image_token: what marks the image in the model's prompts (the processor expands it).
        state_decimals: decimals of each state value.
    """

    template: str
    image_token: str
    state_decimals: int

    def __post_init__(self) -> None:
        if "{image}" not in self.template:
            object.__setattr__(self, "template", "{image}" + self.template)

    def prompts(self, instructions: np.ndarray, states: np.ndarray | None) -> list[str]:
        """Prompts for instructions int[B, L] and states float[B, P] (or None)."""
        return [
            self.template.format(
                instruction=decode_instruction(instructions[i]),
                state=state_text(None if states is None else states[i], self.state_decimals),
                image=self.image_token,
            )
            for i in range(len(instructions))
        ]
