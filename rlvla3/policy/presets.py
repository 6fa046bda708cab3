"""Random-init image-text-to-text checkpoints built from size presets in code, nothing fetched:
written to a directory as a user's downloaded model would be (``save_pretrained``: config,
safetensors weights, processor and tokenizer files), so ``policy.token_vla.path`` loads them
like any other model.

Two families: LLaVA (a CLIP vision tower and a Llama text model joined by a projector) and
Idefics3 / SmolVLM (a SigLIP-like vision tower, pixel shuffle, a Llama text model). The
tokenizer is byte-level BPE with merges learned from the table-top task's prompts (any text
encodes), its special tokens first; the
text model's vocabulary is larger than the tokenizer's, so the highest ids, the action tokens,
are rare tokens no text produces, as in OpenVLA's Llama.

Sizes: ``test`` (d 32, what the tests load, a few hundred kB, about a second to build),
``tiny`` (d 64, a few MB: learns the table-top task on a 2-core CPU, launch/token_vla_tabletop.yaml)
and ``0.5b`` (the real-size benchmark's, bench/token_vla_scale.py: d 1024, 16 heads, MLPs of 4096,
a 12-layer vision tower on 224-pixel images in 14-pixel patches (256 patches, SigLIP/CLIP-like)
and a 24-layer Llama: 558,056,448 parameters as LLaVA, 560,148,480 as Idefics3 (its connector
takes 2 x 2 pixel-shuffled patches, 64 image tokens); saved in bfloat16, 1.1 GB; about 20 s and
2.6 GB of RAM to write on a 2-core CPU). Both towers of the test and tiny sizes see 32-pixel
images in 8-pixel patches; the processors resize any other image size to the preset's.

    python -m rlvla3.policy.presets --family llava --size tiny --out models/llava_tiny
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlvla3.config.typed_load import ConfigError

IMAGE_SIZE = 32
"""Image side the processors expect: the table-top env's ``image_size: 32``."""
PATCH_SIZE = 8
"""Vision patch side: (32 / 8)^2 = 16 patches per image."""
VOCAB_SIZE = 600
"""The text model's vocabulary (the tokenizer has at most 263 + ``MERGES`` ids; the rest are
rare tokens)."""
_SHUFFLE = 2
"""Idefics3's pixel-shuffle factor: 2 x 2 patches make one image token."""
MERGES = 80
"""Most BPE merges the presets' tokenizer learns (``byte_tokenizer``)."""
_SPECIALS = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
]


@dataclass(frozen=True, slots=True)
class ModelSize:
    """How large the towers of a preset are (vision and text share the width).

    Attributes:
        hidden: model width of both towers.
        heads: attention heads of both towers.
        vision_layers: transformer layers of the vision tower.
        text_layers: transformer layers of the Llama text model.
        intermediate: width of both towers' MLPs (0: twice ``hidden``).
        image_size: image side the vision tower and the processor take (the processor resizes
            other sizes to it).
        patch_size: vision patch side: (image_size / patch_size)^2 patches per image.
        dtype: the dtype the weights are saved in (``float32`` or ``bfloat16``: half the
            bytes on disk; the policy's ``policy.token_vla.dtype`` decides the run's dtype).
    """

    hidden: int
    heads: int
    vision_layers: int
    text_layers: int
    intermediate: int = 0
    image_size: int = IMAGE_SIZE
    patch_size: int = PATCH_SIZE
    dtype: str = "float32"

    @property
    def mlp_width(self) -> int:
        """Both towers' MLP width: ``intermediate``, or twice ``hidden`` when it is 0."""
        return self.intermediate or 2 * self.hidden

    @property
    def patches(self) -> int:
        """Vision patches per image."""
        return (self.image_size // self.patch_size) ** 2


SIZES: dict[str, ModelSize] = {
    "test": ModelSize(hidden=32, heads=2, vision_layers=1, text_layers=2),
    "tiny": ModelSize(hidden=64, heads=4, vision_layers=2, text_layers=2),
    "0.5b": ModelSize(
        hidden=1024,
        heads=16,
        vision_layers=12,
        text_layers=24,
        intermediate=4096,
        image_size=224,
        patch_size=14,
        dtype="bfloat16",
    ),
}
"""Size preset name -> tower sizes."""


def _merge_corpus() -> list[str]:
    """Text the tokenizer's merges are learned from: the table-top task's instructions and
    prompts' state text, so a prompt is a few tokens per word or number, as a pretrained
    model's tokenizer makes it (a merge-less byte tokenizer spends one token per character:
    a table-top prompt of about 85 tokens instead of about 42)."""
    colours = ("red", "green", "blue")
    texts = [f"push the {a} block to the {b} target" for a in colours for b in colours]
    for start in range(7):
        values = " ".join(f"{v / 100:.2f}" for v in range(start - 100, 100, 7))
        texts.append(f" State: {values}")
    return texts


def byte_tokenizer(extra_specials: tuple[str, ...] = (), named: dict[str, str] | None = None):
    """A byte-level BPE tokenizer (any text encodes) with ``MERGES`` merges learned from
    ``_merge_corpus``, its special tokens first, ``<image>`` its image token.

    ``extra_specials``: more special tokens after the presets' own (another family's image
    and marker tokens); ``named``: more named special tokens (``{"boi_token": "<boi>"}``),
    which override the defaults (``image_token``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = _SPECIALS + [s for s in extra_specials if s not in _SPECIALS]
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + len(alphabet) + MERGES,
        initial_alphabet=alphabet,
        special_tokens=specials,
        show_progress=False,
    )
    tok.train_from_iterator(_merge_corpus(), trainer)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>", **(named or {})},
    )


def llama_config(vocab_size: int, size: ModelSize = SIZES["test"]):
    """The Llama text model of a preset."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=size.hidden,
        intermediate_size=size.mlp_width,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        vocab_size=vocab_size,
        num_hidden_layers=size.text_layers,
        # room for the image's tokens and as many text tokens
        max_position_embeddings=max(256, 2 * size.patches),
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _vision(size: ModelSize) -> dict:
    return {
        "hidden_size": size.hidden,
        "intermediate_size": size.mlp_width,
        "num_attention_heads": size.heads,
        "num_hidden_layers": size.vision_layers,
        "image_size": size.image_size,
        "patch_size": size.patch_size,
    }


def _llava(vocab_size: int, size: ModelSize):
    import transformers as tf

    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(**_vision(size), projection_dim=size.hidden),
        text_config=llama_config(vocab_size, size),
        image_token_id=4,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    side = size.image_size
    crop = {"height": side, "width": side}
    image_processor = tf.CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size=crop)
    processor = tf.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=byte_tokenizer(),
        patch_size=size.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return tf.LlavaForConditionalGeneration(config), processor


def _idefics3(vocab_size: int, size: ModelSize):
    import transformers as tf

    config = tf.Idefics3Config(
        vision_config=tf.Idefics3VisionConfig(**_vision(size)),
        text_config=llama_config(vocab_size, size),
        image_token_id=4,
        scale_factor=_SHUFFLE,
        tie_word_embeddings=False,
    )
    edge = {"longest_edge": size.image_size}
    image_processor = tf.Idefics3ImageProcessorPil(
        do_image_splitting=False, size=edge, max_image_size=edge
    )
    # the patches, pixel-shuffled by scale_factor 2 (2 x 2 patches per token): the "test"
    # size's (32 / 8)^2 = 16 patches are 4 image tokens
    processor = tf.Idefics3Processor(
        image_processor=image_processor,
        tokenizer=byte_tokenizer(),
        image_seq_len=size.patches // _SHUFFLE**2,
    )
    return tf.Idefics3ForConditionalGeneration(config), processor


FAMILIES: dict[str, Callable] = {"llava": _llava, "idefics3": _idefics3}
"""Model family -> a builder of (random-weight model, processor) from (vocab size, size)."""


def write_vlm(
    directory: Path,
    family: str,
    size: str = "test",
    *,
    vocab_size: int = VOCAB_SIZE,
    seed: int = 0,
) -> Path:
    """Save a random-weight ``family`` model of preset ``size`` and its processor into
    ``directory`` (the same weights for the same seed)."""
    if family not in FAMILIES or size not in SIZES:
        raise ValueError(
            f"no preset {family}/{size} (families {sorted(FAMILIES)}, sizes {sorted(SIZES)})"
        )
    spec = SIZES[size]
    with torch.random.fork_rng(devices=[]):  # leave the caller's generator as it was
        torch.manual_seed(seed)
        model, processor = FAMILIES[family](vocab_size, spec)
    model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype])
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def parse_preset(preset: str, field: str) -> tuple[str, str]:
    """``"llava-tiny"`` -> ``("llava", "tiny")``; a name of no preset is a ``ConfigError``
    naming ``field``."""
    family, _, size = preset.rpartition("-")
    if family not in FAMILIES or size not in SIZES:
        names = [f"{f}-{s}" for f in sorted(FAMILIES) for s in sorted(SIZES)]
        raise ConfigError(f"{field}: no preset {preset!r} (presets: {', '.join(names)})")
    return family, size


def ensure_preset(path: str, preset: str, field: str = "policy.token_vla.preset") -> bool:
    """Write preset ``preset`` into ``path`` unless a model is there (its ``config.json``).
    Returns whether it wrote one."""
    family, size = parse_preset(preset, field)
    directory = Path(path).expanduser()
    if (directory / "config.json").is_file():
        return False
    # written aside, then moved in: a launcher of another node on a shared file system (or
    # one interrupted here) never sees a config.json beside half-written weights
    side = directory.with_name(f"{directory.name}.writing-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(side, ignore_errors=True)
    write_vlm(side, family, size)
    move_model_in(side, directory)
    return True


def move_model_in(side: Path, directory: Path) -> None:
    """Move the model files of ``side`` into ``directory``, ``config.json`` last (a model is
    there once its config is), and remove ``side``."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in sorted(side.iterdir(), key=lambda f: f.name == "config.json"):
        try:
            os.replace(file, directory / file.name)
        except OSError as err:  # ``directory`` on another disk (a mount, a symlink's target)
            if err.errno != errno.EXDEV:
                raise
            shutil.move(file, directory / file.name)
    side.rmdir()


def main(argv: list[str] | None = None) -> None:
    """``python -m rlvla3.policy.presets --family F --size S --out DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    out = write_vlm(Path(args.out), args.family, args.size, seed=args.seed)
    print(f"wrote {args.family}-{args.size} into {out}")


if __name__ == "__main__":
    main()
