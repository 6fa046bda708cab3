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

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


_TOWER = {"hidden_size": WIDTH, "intermediate_size": 2 * WIDTH, "num_attention_heads": 2}
"""What the text and vision towers share."""


def _text(**changes: Any) -> dict:
    """A two-layer text model's config keys (Llama-like names every family reads)."""
    return {
        **_TOWER,
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
        **_TOWER,
        "num_hidden_layers": 1,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        **changes,
    }


SLIDING = 32
"""Aya Vision's sliding attention window: shorter than the prompts here, so the window shapes
what act and evaluate compute (and SFT evaluates its batches padded: packed attention would
see the whole frame)."""
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


def _qwen_vision(**changes: Any) -> dict:
    """A one-layer Qwen2.5-VL / Qwen3-VL vision tower: 8-pixel patches, 2 x 2 merged."""
    return {
        "depth": 1,
        "hidden_size": WIDTH,
        "intermediate_size": 2 * WIDTH,
        "out_hidden_size": WIDTH,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **changes,
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
    vision = _qwen_vision(window_size=2 * PATCH_SIZE, fullatt_block_indexes=[0])
    text = _text(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_qwen_token_ids(ids))
    processor = tf.Qwen2_5_VLProcessor(image_processor=_qwen_image_processor(), tokenizer=tokenizer)
    return tf.Qwen2_5_VLForConditionalGeneration(config), processor


def qwen3_vl():
    """Qwen3-VL: interleaved multimodal rotary positions, a vision tower with learned position
    embeddings interpolated to the image's grid, and DeepStack (vision features of inner
    layers added to the first text layers' hidden states at the image tokens)."""
    import transformers as tf

    tokenizer, ids = _tokenizer(*_QWEN_SPECIALS, image_token="<|image_pad|>")
    # learned positions on a 4 x 4 grid: the 32-pixel image's 8-pixel patches
    vision = _qwen_vision(num_position_embeddings=16, deepstack_visual_indexes=[0])
    text = _text(
        head_dim=16,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
    )
    config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **_qwen_token_ids(ids))
    processor = tf.Qwen3VLProcessor(image_processor=_qwen_image_processor(), tokenizer=tokenizer)
    return tf.Qwen3VLForConditionalGeneration(config), processor


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


def llava_next():
    """LLaVA-NeXT (anyres): a CLIP tower over the whole image and its tiles, tiles unpadded
    with a newline embedding per row; one 32 x 32 grid, so one tile."""
    import transformers as tf

    tokenizer, ids = _tokenizer("<image>")
    grid = [[IMAGE_SIZE, IMAGE_SIZE]]
    config = tf.LlavaNextConfig(
        vision_config=tf.CLIPVisionConfig(**_siglip(), projection_dim=WIDTH),
        text_config=tf.LlamaConfig(**_text()),
        image_token_id=ids["<image>"],
        image_grid_pinpoints=grid,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = tf.LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size=_SQUARE, image_grid_pinpoints=grid
    )
    processor = tf.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return tf.LlavaNextForConditionalGeneration(config), processor


def idefics2():
    """Idefics2: a SigLIP-like tower, a perceiver resampler to 4 latents, a Mistral text model;
    the image between ``<fake_token_around_image>`` markers."""
    import transformers as tf

    markers = ("<fake_token_around_image>", "<image>", "<end_of_utterance>")
    tokenizer, ids = _tokenizer(
        *markers, image_token="<image>", image_boundary_token="<fake_token_around_image>"
    )
    config = tf.Idefics2Config(
        vision_config=_siglip(),
        perceiver_config={
            "hidden_size": WIDTH,
            "resampler_n_latents": 4,
            "resampler_depth": 1,
            "resampler_n_heads": 2,
            "resampler_head_dim": 16,
            "num_key_value_heads": 1,
        },
        text_config=_text(model_type="mistral"),
        image_token_id=ids["<image>"],
        tie_word_embeddings=False,
    )
    image_processor = tf.Idefics2ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE, "shortest_edge": IMAGE_SIZE}
    )
    processor = tf.Idefics2Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4
    )
    return tf.Idefics2ForConditionalGeneration(config), processor


def aya_vision():
    """Aya Vision: a SigLIP tower, pixel shuffle by 2 (4 tokens per image), a Cohere 2 text
    model; the image as ``<|IMG_PATCH|>`` tokens between start and end markers."""
    import transformers as tf

    markers = ("<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>")
    tokenizer, ids = _tokenizer(*markers)
    config = tf.AyaVisionConfig(
        vision_config=tf.SiglipVisionConfig(**_siglip()),
        text_config=tf.Cohere2Config(**_text(sliding_window=SLIDING, layer_types=None)),
        downsample_factor=2,
        image_token_index=ids["<|IMG_PATCH|>"],
        tie_word_embeddings=False,
    )
    image_processor = tf.GotOcr2ImageProcessorPil(crop_to_patches=False, size=_SQUARE)
    processor = tf.AyaVisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        img_size=IMAGE_SIZE,
        downsample_factor=2,
    )
    return tf.AyaVisionForConditionalGeneration(config), processor


def _video_processor(name: str) -> Any:
    """The family's video processor (class ``name``, its defaults) where torchvision is
    installed, so that the whole processor is saved and loads with its own settings (image
    tokens per image...); None without torchvision (built for images only)."""
    import importlib.util

    import transformers as tf

    return getattr(tf, name)() if importlib.util.find_spec("torchvision") else None


def smolvlm():
    """SmolVLM (SmolVLA's backbone): a SigLIP tower, pixel shuffle by 2 (4 tokens per image),
    a Llama text model; the image between ``<fake_token_around_image>`` and ``<global-img>``
    markers. Its processor spells numbers out, with ``num2words`` (the ``models`` extra)."""
    import transformers as tf

    markers = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
    tokenizer, ids = _tokenizer(
        *markers, image_token="<image>", image_boundary_token="<fake_token_around_image>"
    )
    config = tf.SmolVLMConfig(
        vision_config=_siglip(),
        text_config=_text(model_type="llama"),
        scale_factor=2,
        image_token_id=ids["<image>"],
        tie_word_embeddings=False,
    )
    edge = {"longest_edge": IMAGE_SIZE}
    image_processor = tf.SmolVLMImageProcessorPil(
        do_image_splitting=False, size=edge, max_image_size=edge
    )
    processor = tf.SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_video_processor("SmolVLMVideoProcessor"),
        image_seq_len=4,
    )
    return tf.SmolVLMForConditionalGeneration(config), processor


def llava_onevision():
    """LLaVA-OneVision (anyres): a SigLIP tower over the whole image and its tiles, a Qwen2
    text model; one 32 x 32 grid, so one tile."""
    import transformers as tf

    tokenizer, ids = _tokenizer("<image>", "<video>", image_token="<image>", video_token="<video>")
    grid = [[IMAGE_SIZE, IMAGE_SIZE]]
    config = tf.LlavaOnevisionConfig(
        vision_config=tf.SiglipVisionConfig(**_siglip()),
        text_config=tf.Qwen2Config(**_text()),
        image_token_id=ids["<image>"],
        video_token_id=ids["<video>"],
        image_grid_pinpoints=grid,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = tf.LlavaOnevisionImageProcessorPil(size=_SQUARE, image_grid_pinpoints=grid)
    processor = tf.LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_video_processor("LlavaOnevisionVideoProcessor"),
        num_image_tokens=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_select_strategy="full",
    )
    return tf.LlavaOnevisionForConditionalGeneration(config), processor


def internvl():
    """InternVL: an InternViT tower, pixel shuffle by 2 (4 tokens per image), a Qwen2 text
    model; the image as ``<IMG_CONTEXT>`` tokens between ``<img>`` and ``</img>``."""
    import transformers as tf

    markers = ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")
    tokenizer, ids = _tokenizer(
        *markers,
        start_image_token="<img>",
        end_image_token="</img>",
        context_image_token="<IMG_CONTEXT>",
        video_token="<video>",
    )
    vision = tf.InternVLVisionConfig(
        **_TOWER,
        num_hidden_layers=1,
        image_size=[IMAGE_SIZE, IMAGE_SIZE],
        patch_size=[PATCH_SIZE, PATCH_SIZE],
    )
    config = tf.InternVLConfig(
        vision_config=vision,
        text_config=_text(model_type="qwen2"),
        image_token_id=ids["<IMG_CONTEXT>"],
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    image_processor = tf.GotOcr2ImageProcessorPil(crop_to_patches=False, size=_SQUARE)
    processor = tf.InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_video_processor("InternVLVideoProcessor"),
        image_seq_length=4,
    )
    return tf.InternVLForConditionalGeneration(config), processor


def mistral3():
    """Mistral 3: a Pixtral tower (2-D rotary positions), patches merged 2 x 2, a Mistral text
    model; the image as rows of ``[IMG]`` tokens, each row ended by ``[IMG_BREAK]``, the
    last by ``[IMG_END]``. ``PixtralProcessor`` is constructed only with torchvision."""
    import transformers as tf

    markers = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
    tokenizer, ids = _tokenizer(
        *markers, image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]"
    )
    vision = tf.PixtralVisionConfig(
        **_TOWER, num_hidden_layers=1, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, head_dim=16
    )
    config = tf.Mistral3Config(
        vision_config=vision,
        text_config=_text(model_type="mistral"),
        image_token_index=ids["[IMG]"],
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    image_processor = tf.PixtralImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE}, patch_size=PATCH_SIZE
    )
    processor = tf.PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        spatial_merge_size=2,
    )
    return tf.Mistral3ForConditionalGeneration(config), processor


def mllama():
    """Mllama (Llama 3.2 Vision): the image enters through cross-attention layers, not as
    tokens; one ``<|image|>`` token marks it, and ``cross_attention_mask`` [B, L, images,
    tiles] says per token which images' tiles it attends to."""
    import transformers as tf

    tokenizer, ids = _tokenizer("<|image|>", image_token="<|image|>")
    vision = {
        "hidden_size": WIDTH,
        "intermediate_size": 2 * WIDTH,
        "attention_heads": 2,
        "num_hidden_layers": 2,
        "num_global_layers": 1,
        "intermediate_layers_indices": [0],
        "vision_output_dim": 2 * WIDTH,  # the last layer's and one intermediate layer's
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "max_num_tiles": 1,
        "supported_aspect_ratios": [[1, 1]],
    }
    text = _text(cross_attention_layers=[1])
    config = tf.MllamaConfig(
        vision_config=vision, text_config=text, image_token_index=ids["<|image|>"]
    )
    image_processor = tf.MllamaImageProcessorPil(size=_SQUARE, max_image_tiles=1)
    processor = tf.MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return tf.MllamaForConditionalGeneration(config), processor


FAMILY_BUILDERS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "paligemma": paligemma,
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_5_vl,
    "qwen3_vl": qwen3_vl,
    "gemma3": gemma3,
    "llava_next": llava_next,
    "idefics2": idefics2,
    "aya_vision": aya_vision,
    "smolvlm": smolvlm,
    "llava_onevision": llava_onevision,
    "internvl": internvl,
    "mistral3": mistral3,
    "mllama": mllama,
}
"""Family -> a builder of its (random-weight model, processor)."""


VIDEO_FAMILIES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm", "llava_onevision", "internvl"}
)
"""Families whose processor has a video processor: ``transformers`` constructs and loads one
only with torchvision, whose CPU wheel is not on PyPI. Built here without it (images only),
their directories load where torchvision is installed and are one clear error elsewhere."""

TORCHVISION_FAMILIES = frozenset({"mistral3"})
"""Families whose processor is not constructed at all without torchvision (Pixtral's)."""


@contextmanager
def _video_processor_optional() -> Iterator[None]:
    """Lets a processor be constructed without its video processor: ``transformers`` checks
    every part's class, and without torchvision the video processor's class is a stand-in."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, argument):
        return None if argument is None else check(self, name, argument)

    ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def build_family(family: str, seed: int = 0) -> tuple[Any, Any]:
    """A random-weight ``family`` model (the same weights for the same seed) and its
    processor, in memory."""
    with torch.random.fork_rng(devices=[]), _video_processor_optional():
        torch.manual_seed(seed)  # leaves the caller's generator as it was
        return FAMILY_BUILDERS[family]()


def write_family(directory: Path, family: str, seed: int = 0) -> Path:
    """Save a random-weight ``family`` model and its processor into ``directory``; a processor
    without its video processor as its parts (tokenizer, image processor, the processor's
    class in processor_config.json), the files a download of it has for images."""
    model, processor = build_family(family, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if getattr(processor, "video_processor", True) is None:
        processor.tokenizer.save_pretrained(directory)
        processor.image_processor.save_pretrained(directory)
        kind = {"processor_class": type(processor).__name__}
        (directory / "processor_config.json").write_text(json.dumps(kind))
    else:
        processor.save_pretrained(directory)
    return directory
