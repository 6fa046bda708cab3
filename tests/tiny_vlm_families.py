"""Tiny random-weight checkpoints of the image-text-to-text families that ``rlvla3`` names
nowhere (PaliGemma, Qwen2-VL, Gemma 3...), each with its own working processor: the family's
processor class, its image processor constructed directly for ``IMAGE_SIZE`` pixels, and a
byte-level tokenizer (``rlvla3.policy.presets.byte_tokenizer``) that has the family's special
tokens. Written with ``save_pretrained`` into a directory, as a user's download is laid out;
nothing is fetched.

Each checkpoint is a few hundred kB (width 32, one or two layers, 32-pixel images), so a
family's whole policy check takes seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlvla3.policy.presets import IMAGE_SIZE, PATCH_SIZE, VOCAB_SIZE, byte_tokenizer

WIDTH = 32
"""Width of every tower of these checkpoints."""
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _tokenizer(*specials: str, **named: str):
    """The presets' byte tokenizer with ``specials`` added, and the token ids of all of them."""
    tokenizer = byte_tokenizer(tuple(specials), named)
    return tokenizer, {s: tokenizer.convert_tokens_to_ids(s) for s in specials}


def _text(**changes: Any) -> dict:
    """A one-layer text model's config keys (Llama-like names every family reads)."""
    return {
        "hidden_size": WIDTH,
        "intermediate_size": 2 * WIDTH,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        **_IDS,
        **changes,
    }


def _siglip(**changes: Any) -> dict:
    """A one-layer SigLIP / CLIP-like vision tower: (32 / 8)^2 = 16 patches per image."""
    return {
        "hidden_size": WIDTH,
        "intermediate_size": 2 * WIDTH,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        **changes,
    }


_SQUARE = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}


def paligemma():
    """PaliGemma: a SigLIP tower, a Gemma text model; the prompt is a bidirectional prefix
    (``token_type_ids`` 0) and what follows it causal."""
    import transformers as tf

    tokenizer, ids = _tokenizer("<image>")
    image_processor = tf.SiglipImageProcessorPil(size=_SQUARE)
    image_processor.image_seq_length = (IMAGE_SIZE // PATCH_SIZE) ** 2
    config = tf.PaliGemmaConfig(
        text_config=_text(model_type="gemma", num_key_value_heads=1, head_dim=16),
        vision_config=_siglip(),
        projection_dim=WIDTH,
        image_token_id=ids["<image>"],
        tie_word_embeddings=False,
    )
    processor = tf.PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return tf.PaliGemmaForConditionalGeneration(config), processor


def _qwen_image_processor():
    import transformers as tf

    # 32 x 32 pixels in 8-pixel patches, 2 x 2 merged: 4 image tokens
    return tf.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
        patch_size=PATCH_SIZE,
        merge_size=2,
        temporal_patch_size=2,
    )


_QWEN_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _qwen_token_ids(ids: dict[str, int]) -> dict:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def qwen2_vl():
    """Qwen2-VL: multimodal rotary positions (3-D position ids from the image grid)."""
    import transformers as tf

    tokenizer, ids = _tokenizer(*_QWEN_SPECIALS, image_token="<|image_pad|>")
    vision = {
        "depth": 1,
        "embed_dim": WIDTH,
        "hidden_size": WIDTH,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    text = _text(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
    config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **_qwen_token_ids(ids))
    processor = tf.Qwen2VLProcessor(image_processor=_qwen_image_processor(), tokenizer=tokenizer)
    return tf.Qwen2VLForConditionalGeneration(config), processor


def qwen2_5_vl():
    """Qwen2.5-VL: Qwen2-VL with a windowed-attention vision tower."""
    import transformers as tf

    tokenizer, ids = _tokenizer(*_QWEN_SPECIALS, image_token="<|image_pad|>")
    vision = {
        "depth": 1,
        "hidden_size": WIDTH,
        "intermediate_size": 2 * WIDTH,
        "out_hidden_size": WIDTH,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 2 * PATCH_SIZE,
        "fullatt_block_indexes": [0],
    }
    text = _text(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_qwen_token_ids(ids))
    processor = tf.Qwen2_5_VLProcessor(image_processor=_qwen_image_processor(), tokenizer=tokenizer)
    return tf.Qwen2_5_VLForConditionalGeneration(config), processor


def gemma3():
    """Gemma 3: a SigLIP tower pooled to 4 soft tokens between begin/end-of-image markers;
    ``token_type_ids`` mark the image tokens (bidirectional among themselves)."""
    import transformers as tf

    markers = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    tokenizer, ids = _tokenizer(
        *markers,
        boi_token="<start_of_image>",
        eoi_token="<end_of_image>",
        image_token="<image_soft_token>",
    )
    text = tf.Gemma3TextConfig(
        **_text(num_key_value_heads=1, head_dim=16, sliding_window=64, layer_types=None)
    )
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=_siglip(),
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False,
    )
    image_processor = tf.Gemma3ImageProcessorPil(size=_SQUARE)
    processor = tf.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4
    )
    return tf.Gemma3ForConditionalGeneration(config), processor


FAMILY_BUILDERS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "paligemma": paligemma,
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_5_vl,
    "gemma3": gemma3,
}
"""Family -> a builder of its (random-weight model, processor)."""


def write_family(directory: Path, family: str, seed: int = 0) -> Path:
    """Save a random-weight ``family`` model and its processor into ``directory``."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's generator as it was
        torch.manual_seed(seed)
        model, processor = FAMILY_BUILDERS[family]()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
