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

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rlvla3.policy.hf_model import processor_inputs

_log = logging.getLogger(__name__)

PIXELS = "pixel_values"
"""The one processor output computed from the pixels."""
MAX_PROMPTS = 4096
"""Distinct prompts whose text tensors stay cached (least recently used go first)."""
PROBE_ATOL = 1e-5
"""Largest difference from the processor's ``pixel_values`` accepted (float32 rounding of the
same arithmetic in another order; the model then takes them in its own dtype)."""


class DeviceInputs:
    """The processor's model inputs for uint8[B, H, W, 3] images and B prompts, built without
    it once each prompt was seen; ``probe`` says whether this processor allows it.

    Not thread-safe (reading the prompt cache reorders it): each policy copy has its own, and
    one thread acts with a copy (a rollout server's standby copy is another policy)."""

    def __init__(
        self, processor: Any, image_token: str, image_shape: tuple[int, ...], scale, mean, std
    ) -> None:
        self.processor = processor
        self.image_token = image_token
        self.probe_image = np.zeros(image_shape, np.uint8)
        """The image new prompts' tokens are computed with (they do not depend on it)."""
        self.scale = float(scale)
        self.mean = torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        self.pad_id = int(processor.tokenizer.pad_token_id or 0)
        self.pixel_shape: tuple[int, ...] = ()
        """One image's ``pixel_values`` shape, without the batch dimension."""
        self.token_keys: tuple[str, ...] = ()
        """Outputs with one value per token (input_ids, attention_mask...): cached per prompt."""
        self.fixed: dict[str, Tensor] = {}
        """Outputs the same for every image and prompt (Idefics3's ``pixel_attention_mask``):
        one row each, expanded to the batch."""
        self.prompts: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        self.on_device: dict[torch.device, tuple[Tensor, Tensor, dict[str, Tensor]]] = {}
        """Device -> (mean, std, fixed) there, moved once."""

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
        alone = [self._processed(images[:1], [prompt]) for prompt in prompts]
        lengths = [row["attention_mask"].shape[1] for row in alone]
        others = [k for k in alone[0] if k != PIXELS]
        self.token_keys = tuple(
            k
            for k in others
            if all(
                r[k].dim() == 2 and r[k].shape[1] == n for r, n in zip(alone, lengths, strict=True)
            )
        )
        self.fixed = {k: alone[0][k] for k in others if k not in self.token_keys}
        for key, value in self.fixed.items():
            if not all(torch.equal(value, row[key]) for row in alone):
                return f"its {key!r} changes with the prompt"
        theirs = self._processed(images, prompts)
        ours = self(torch.from_numpy(images), prompts)
        if set(ours) != set(theirs):
            return f"it returns {sorted(theirs)}"
        for key, value in theirs.items():
            same = ours[key].shape == value.shape and ours[key].dtype == value.dtype
            if key == PIXELS:
                same = same and (ours[key] - value).abs().max().item() <= PROBE_ATOL
            else:
                same = same and torch.equal(ours[key], value)
            if not same:
                return f"its {key!r} differs from ours (it resizes, crops or pads otherwise)"
        return ""

    def _processed(self, images: np.ndarray, prompts: list[str]) -> dict[str, Tensor]:
        return processor_inputs(self.processor, images, prompts)

    def fits(self, images: Tensor | np.ndarray) -> bool:
        """Whether ``images`` are uint8 pixels of the probed size: the probe and the cached
        prompts hold for it alone (demos recorded at another size go to the processor)."""
        uint8 = images.dtype == torch.uint8 or images.dtype == np.uint8
        return uint8 and tuple(images.shape[1:]) == self.probe_image.shape

    def __call__(self, images: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """Model inputs for uint8[B, H, W, 3] ``images`` (on any device: everything is
        returned there, ``pixel_values`` float32) and B ``prompts``."""
        if not self.fits(images) or len(prompts) != len(images) or not prompts:
            raise ValueError(
                f"policy.token_vla.observation.image: {len(prompts)} prompts and images of "
                f"{images.dtype} {tuple(images.shape)}, where the probe took uint8 "
                f"[B, {', '.join(map(str, self.probe_image.shape))}]"
            )
        device = images.device
        mean, std, fixed = self._constants(device)
        rows = self._token_rows(prompts)
        width = max(row["attention_mask"].shape[1] for row in rows)
        inputs = {}
        for key in self.token_keys:
            # right-padded as the processor pads: the tokenizer's pad id, else 0
            pad = self.pad_id if key == "input_ids" else 0
            parts = [F.pad(row[key], (0, width - row[key].shape[1]), value=pad) for row in rows]
            inputs[key] = torch.cat(parts).to(device)
        for key, value in fixed.items():
            inputs[key] = value.expand(len(prompts), *value.shape[1:])
        pixels = images.to(torch.float32).permute(0, 3, 1, 2) * self.scale
        inputs[PIXELS] = ((pixels - mean) / std).reshape(len(prompts), *self.pixel_shape)
        return inputs

    def _constants(self, device: torch.device) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """The mean, std and fixed outputs on ``device`` (moved there once)."""
        if device not in self.on_device:
            fixed = {k: v.to(device) for k, v in self.fixed.items()}
            self.on_device[device] = (self.mean.to(device), self.std.to(device), fixed)
        return self.on_device[device]

    def _token_rows(self, prompts: list[str]) -> list[dict[str, Tensor]]:
        """Each prompt's per-token tensors int64[1, L]; the prompts not cached yet are
        processed in one call (with blank images: the tokens do not depend on the pixels) and
        each row cut at its length (the batch is right-padded)."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self.prompts))
        if missing:
            blank = np.broadcast_to(self.probe_image, (len(missing), *self.probe_image.shape))
            batch = self._processed(blank, missing)
            lengths = batch["attention_mask"].sum(1).tolist()
            for i, (prompt, n) in enumerate(zip(missing, lengths, strict=True)):
                self.prompts[prompt] = {k: batch[k][i : i + 1, :n].clone() for k in self.token_keys}
        rows = []
        for prompt in prompts:
            self.prompts.move_to_end(prompt)
            rows.append(self.prompts[prompt])
        while len(self.prompts) > MAX_PROMPTS:
            self.prompts.popitem(last=False)
        return rows


def probed(processor: Any, image_token: str, image_shape: tuple[int, ...]) -> DeviceInputs | None:
    """``DeviceInputs.probe``, logging which path the policy's inputs take and why."""
    shortcut, why_not = DeviceInputs.probe(processor, image_token, image_shape)
    if shortcut is None:
        _log.info("policy.token_vla: the processor builds each batch on the CPU (%s)", why_not)
    else:
        _log.info("policy.token_vla: pixels normalised on the model's device, prompts cached")
    return shortcut


def batch_inputs(
    processor: Any,
    shortcut: DeviceInputs | None,
    images: Tensor | np.ndarray,
    prompts: list[str],
    device: torch.device,
) -> dict[str, Tensor]:
    """A batch's model inputs: through ``shortcut`` on ``device`` where it takes these uint8
    [B, H, W, 3] ``images``, else through the processor on the CPU."""
    if shortcut is None or not shortcut.fits(images):
        if isinstance(images, Tensor):
            images = images.detach().cpu().numpy()
        return processor_inputs(processor, np.asarray(images), prompts)
    if not isinstance(images, Tensor):
        images = np.asarray(images)  # (a received array is read-only; torch wants writable)
        images = torch.from_numpy(images if images.flags.writeable else images.copy())
    return shortcut(images.to(device), prompts)
