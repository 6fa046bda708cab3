"""Tiny random-weight image-text-to-text checkpoints, written to a directory as a user's
downloaded model would be (``save_pretrained``: config, safetensors weights, processor and
tokenizer files), built from ``transformers``' config classes with nothing fetched.

Two families: LLaVA (a CLIP vision tower and a Llama text model joined by a projector) and
Idefics3 / SmolVLM (a SigLIP-like vision tower, pixel shuffle, a Llama text model). Each is a
few hundred kB and builds in about a second on CPU. The tokenizer is byte-level BPE with no
merges (any text encodes), its special tokens first; the text model's vocabulary is larger
than the tokenizer's, so the highest ids, the action tokens, are rare tokens no text produces,
as in OpenVLA's Llama.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

IMAGE_SIZE = 32
"""Image side the tiny processors expect (the table-top env's ``image_size`` in tests)."""
VOCAB_SIZE = 600
"""The text model's vocabulary (the tokenizer has 263 ids)."""
_TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
"""Width of every tower (vision and text)."""
_TINY_VISION = {**_TINY, "image_size": IMAGE_SIZE, "patch_size": 8, "num_hidden_layers": 1}
_SPECIALS = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
]


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges, ``<image>`` its image token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(_SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )


def _llama(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        **_TINY,
        vocab_size=vocab_size,
        num_hidden_layers=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _llava(vocab_size: int):
    import transformers as tf

    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(**_TINY_VISION, projection_dim=32),
        text_config=_llama(vocab_size),
        image_token_id=4,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    image_processor = tf.CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=size)
    processor = tf.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=byte_tokenizer(),
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return tf.LlavaForConditionalGeneration(config), processor


def _idefics3(vocab_size: int):
    import transformers as tf

    config = tf.Idefics3Config(
        vision_config=tf.Idefics3VisionConfig(**_TINY_VISION),
        text_config=_llama(vocab_size),
        image_token_id=4,
        scale_factor=2,
        tie_word_embeddings=False,
    )
    edge = {"longest_edge": IMAGE_SIZE}
    image_processor = tf.Idefics3ImageProcessorPil(
        do_image_splitting=False, size=edge, max_image_size=edge
    )
    # (32 / 8)^2 patches, pixel-shuffled by scale_factor 2: 4 image tokens
    processor = tf.Idefics3Processor(
        image_processor=image_processor, tokenizer=byte_tokenizer(), image_seq_len=4
    )
    return tf.Idefics3ForConditionalGeneration(config), processor


FAMILIES: dict[str, Callable] = {"llava": _llava, "idefics3": _idefics3}
"""Model family -> a builder of (random-weight model, processor)."""


def write_tiny_vlm(
    directory: Path, family: str, *, vocab_size: int = VOCAB_SIZE, seed: int = 0
) -> Path:
    """Save a tiny random-weight ``family`` model and its processor into ``directory``."""
    torch.manual_seed(seed)
    model, processor = FAMILIES[family](vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
