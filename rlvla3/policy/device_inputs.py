"""A model's processor with its image half on the model's device.

A ``transformers`` processor turns each batch of images and prompts into model inputs on the
CPU: per image a PIL conversion, rescaling and normalising in numpy, and per prompt the
tokenizer. For a 0.5B model on a GPU that is most of what acting costs beyond the model itself
(docs/models.md, "At real size"). Most image processors, given an image already at their size,
compute ``(pixels * rescale_factor - mean) / std`` in CHW layout, and their text half depends on
the prompt and the image's size, never on its pixels. ``DeviceInputs`` computes the same inputs
that way: the pixels normalised in torch on whatever device they are on, each prompt's text
tensors cached from one processor call.

The shortcut is taken only where a probe at load shows it computes what the processor
computes, for this processor at the env's image size: the outputs that change with the
pixels are ``pixel_values`` alone, ours equal the processor's, and a batch of prompts of
different lengths collates to the processor's batch exactly. Anything else (a processor that
resizes, crops, tiles or flattens patches: Qwen2-VL's) keeps the processor, and ``reason`` says
why.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rlvla3.policy.hf_model import model_inputs, pil_images

PIXELS = "pixel_values"
"""The one processor output computed from the pixels."""
MAX_PROMPTS = 4096
"""Distinct prompts whose text tensors stay cached (least recently used go first)."""
PROBE_ATOL = 1e-5
"""Largest difference from the processor's ``pixel_values`` accepted (float32 rounding of the
same arithmetic in another order; the model then takes them in its own dtype)."""


class DeviceInputs:
    """The processor's model inputs for uint8[B, H, W, 3] images and B prompts, built without
    it once each prompt was seen; ``probe`` says whether this processor allows it."""

    def __init__(
        self, processor: Any, image_token: str, image_shape: tuple[int, ...], scale, mean, std
    ) -> None:
        self.processor = processor
        self.image_token = image_token
        self.probe_image = np.zeros(image_shape, np.uint8)
        """The image a new prompt's text tensors are computed with (they do not depend on it)."""
        self.scale = float(scale)
        self.mean = torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        self.pad_id = int(processor.tokenizer.pad_token_id or 0)
        self.pixel_shape: tuple[int, ...] = ()
        """One image's ``pixel_values`` shape, without the batch dimension."""
        self.prompts: OrderedDict[str, dict[str, Tensor]] = OrderedDict()

    @classmethod
    def probe(
        cls, processor: Any, image_token: str, image_shape: tuple[int, ...]
    ) -> tuple[DeviceInputs | None, str]:
        """(the shortcut, "") where it computes what ``processor`` does at ``image_shape``;
        else (None, why not)."""
        image_processor = getattr(processor, "image_processor", None)
        scale = getattr(image_processor, "rescale_factor", None)
        if not getattr(image_processor, "do_rescale", False) or scale is None:
            return None, "its image processor does not rescale pixels by a factor"
        mean = getattr(image_processor, "image_mean", None)
        std = getattr(image_processor, "image_std", None)
        if not getattr(image_processor, "do_normalize", False) or mean is None or std is None:
            return None, "its image processor does not normalise by a mean and std"
        try:
            shortcut = cls(processor, image_token, image_shape, scale, mean, std)
            reason = shortcut._check()
        except Exception as err:  # any processor or shape this shortcut does not model
            return None, f"{type(err).__name__}: {err}"
        return (None, reason) if reason else (shortcut, "")

    def _check(self) -> str:
        """ "" where the shortcut equals the processor on random images and prompts of three
        lengths, else why not (and the shortcut must not be used)."""
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (3, *self.probe_image.shape), np.uint8)
        token = self.image_token
        prompts = [f"{token}go\n", f"{token}push the red block to the blue target\n", token]
        one = [self._processed(images[i : i + 1], prompts[:1]) for i in range(2)]
        moved = {k for k in one[0] if not torch.equal(one[0][k], one[1][k])}
        if moved != {PIXELS} or set(one[0]) != set(one[1]):
            return f"its outputs that change with the pixels are {sorted(moved)}, not [{PIXELS!r}]"
        self.pixel_shape = tuple(one[0][PIXELS].shape[1:])
        if int(np.prod(self.pixel_shape)) != int(np.prod(self.probe_image.shape)):
            return f"its pixel_values {tuple(one[0][PIXELS].shape)} are not the image's pixels"
        theirs = self._processed(images, prompts)
        ours = self(torch.from_numpy(images), prompts)
        if set(ours) != set(theirs):
            return f"it returns {sorted(theirs)}"
        for key, value in theirs.items():
            same = (
                ours[key].shape == value.shape
                and (ours[key] - value).abs().max().item() <= PROBE_ATOL
                if key == PIXELS
                else torch.equal(ours[key], value)
            )
            if not same:
                return f"its {key!r} differs from normalised pixels (it resizes or crops)"
        return ""

    def _processed(self, images: np.ndarray, prompts: list[str]) -> dict[str, Tensor]:
        batch = self.processor(
            images=pil_images(images),
            text=prompts,
            return_tensors="pt",
            padding=True,
            padding_side="right",
        )
        return model_inputs(batch)

    def fits(self, images: Tensor | np.ndarray) -> bool:
        """Whether uint8[B, H, W, 3] ``images`` are of the probed size: the probe and the
        cached text hold for it alone (demos recorded at another size go to the processor)."""
        return tuple(images.shape[1:]) == self.probe_image.shape

    def __call__(self, images: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """Model inputs for uint8[B, H, W, 3] ``images`` (on any device: ``pixel_values`` are
        computed there, float32) and B ``prompts`` (text tensors on the images' device)."""
        if not self.fits(images):
            raise ValueError(
                f"policy.token_vla.observation.image: images of shape {tuple(images.shape[1:])}, "
                f"where the probe took {self.probe_image.shape}"
            )
        rows = [self._text(prompt) for prompt in prompts]
        lengths = [row["attention_mask"].shape[1] for row in rows]
        width = max(lengths)
        inputs = {}
        for key in rows[0]:
            parts = [row[key] for row in rows]
            # a token-aligned tensor (input_ids, attention_mask, token_type_ids) pads on the
            # right as the processor pads: the tokenizer's pad id, else 0
            if all(p.dim() == 2 and p.shape[1] == n for p, n in zip(parts, lengths, strict=True)):
                pad = self.pad_id if key == "input_ids" else 0
                parts = [F.pad(p, (0, width - p.shape[1]), value=pad) for p in parts]
            inputs[key] = torch.cat(parts).to(images.device)
        pixels = images.to(torch.float32).permute(0, 3, 1, 2) * self.scale
        mean, std = self.mean.to(images.device), self.std.to(images.device)
        inputs[PIXELS] = ((pixels - mean) / std).reshape(len(prompts), *self.pixel_shape)
        return inputs

    def _text(self, prompt: str) -> dict[str, Tensor]:
        """One prompt's text tensors (int64[1, L] each, or a fixed-shape per-image tensor)."""
        cached = self.prompts.get(prompt)
        if cached is not None:
            self.prompts.move_to_end(prompt)
            return cached
        processed = self._processed(self.probe_image[None], [prompt])
        processed.pop(PIXELS)
        self.prompts[prompt] = processed
        if len(self.prompts) > MAX_PROMPTS:
            self.prompts.popitem(last=False)
        return processed
