"""The token VLA's state projector (``policy.token_vla.state_projector``, OpenVLA-OFT's proprio
projector): the state vector enters the model as one learned embedding, not as digits.

An MLP maps ``observation.state`` float[P] to a vector of the language model's width, which is
added to the input embedding of each prompt's last token: the position whose hidden state
predicts the first action token and feeds the value head. A value then reaches the model as a
continuous input through a linear layer, as our own VLA's proprio does, instead of as digit
tokens whose embeddings are a lookup table.

The vector is added by a forward hook on the model's input embedding (``get_input_embeddings``),
which every ``transformers`` family calls on its ``input_ids`` before it merges the image
features in, so no family's forward needs another input. The hook adds only to an embedding
call that covers the places it was given: the prompts' forward (padded or packed, with or
without action tokens after the prompts), not a cached decoding step's one-token call.

The projector's last layer starts at zero, so a pretrained model's outputs are unchanged until
training moves it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn


class StateProjector(nn.Module):
    """float[B, P] states -> float32[B, width] embeddings (Linear, GELU, Linear)."""

    def __init__(self, state_dim: int, hidden: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(state_dim, hidden), nn.GELU(), nn.Linear(hidden, width))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, state: Tensor) -> Tensor:
        return self.net(state.reshape(len(state), -1).float())


@contextmanager
def added_to_input_embeddings(
    model: nn.Module, rows: Tensor, columns: Tensor, vectors: Tensor
) -> Iterator[None]:
    """While inside, the model's input-embedding calls that cover row ``rows[i]`` and column
    ``columns[i]`` of their ``[R, W]`` token ids get ``vectors[i]`` added there (int64[B],
    int64[B], float[B, width]); the sum keeps the gradient to ``vectors``."""
    limits = (int(rows.max()), int(columns.max()))

    def add(_module: nn.Module, _args: tuple, output: Tensor) -> Tensor:
        if output.dim() != 3 or output.shape[0] <= limits[0] or output.shape[1] <= limits[1]:
            return output
        return output.index_put((rows, columns), vectors.to(output.dtype), accumulate=True)

    handle = model.get_input_embeddings().register_forward_hook(add)
    try:
        yield
    finally:
        handle.remove()
