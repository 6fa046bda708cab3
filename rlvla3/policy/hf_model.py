"""Load a ``transformers`` image-text-to-text model and its processor from a local directory,
checked at setup so that a wrong directory is one clear ``ConfigError`` naming
``policy.token_vla.path``, never a traceback from deep inside ``transformers``.

Nothing is fetched: every load passes ``local_files_only=True``. ``transformers`` is imported
here only, so a run without a token VLA never needs the ``models`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlvla3.config.token_vla import ModelDType
from rlvla3.config.typed_load import ConfigError

_FIELD = "policy.token_vla.path"


@dataclass(frozen=True, slots=True)
class LoadedVLM:
    """A model and what acting with it needs from its processor.

    Attributes:
        model: the ``AutoModelForImageTextToText`` model, input and output embeddings untied.
        processor: its ``AutoProcessor`` (image processor + tokenizer), padding on the right.
        image_token: the text that marks where the image goes in a prompt.
        special_ids: every special or added token id (never an action token).
        vocab_size: rows of the output embedding (the logits' last dimension).
    """

    model: nn.Module
    processor: Any
    image_token: str
    special_ids: frozenset[int]
    vocab_size: int


def resolve_dtype(dtype: ModelDType) -> torch.dtype:
    """The torch dtype ``policy.token_vla.dtype`` names."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def load_vlm(path: str, dtype: torch.dtype) -> LoadedVLM:
    """The model and processor saved in directory ``path`` (``save_pretrained``'s layout)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"{_FIELD}: no such directory: {path!r}")
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{_FIELD}: {path!r} has no config.json (not a saved model directory)")
    transformers = _import_transformers()
    config = _load(transformers.AutoConfig, directory, "the model's config.json")
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        raise ConfigError(
            f"{_FIELD}: {path!r} holds a {config.model_type!r} model, not an image-text-to-text "
            "model (AutoModelForImageTextToText: LLaVA, Idefics3/SmolVLM, PaliGemma, Qwen2-VL...)"
        )
    processor = _load(transformers.AutoProcessor, directory, "its processor")
    tokenizer = getattr(processor, "tokenizer", None)
    image_token = getattr(processor, "image_token", None)
    if getattr(processor, "image_processor", None) is not None and tokenizer and not image_token:
        raise ConfigError(
            f"{_FIELD}: {path!r} holds a {config.model_type!r} model whose processor "
            f"({type(processor).__name__}) puts no image token in the text: the token VLA "
            "needs a family that does (LLaVA, Idefics3/SmolVLM, PaliGemma, Qwen2-VL...)"
        )
    if getattr(processor, "image_processor", None) is None or tokenizer is None or not image_token:
        raise ConfigError(
            f"{_FIELD}: {path!r} lacks the processor files (processor_config.json or "
            "preprocessor_config.json, and the tokenizer's files): an image processor, a "
            "tokenizer and an image token are needed"
        )
    if torch.get_default_device().type == "meta":
        # the launcher's LoRA check (rlvla3.policy.factory.check_lora_targets): the module
        # structure alone, without reading the weights (from_pretrained refuses the meta device)
        auto = transformers.AutoModelForImageTextToText
        return wrap_vlm(auto.from_config(config, dtype=dtype), processor)
    model = _load(transformers.AutoModelForImageTextToText, directory, "the weights", dtype=dtype)
    return wrap_vlm(model, processor)


def wrap_vlm(model: nn.Module, processor: Any) -> LoadedVLM:
    """An image-text-to-text model and its processor, already in memory, as the policy uses
    them: the tokenizer padding on the right, the output embeddings untied."""
    tokenizer, image_token = processor.tokenizer, processor.image_token
    tokenizer.padding_side = "right"  # prompts end where their action tokens begin
    _untie_output_embeddings(model)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    special.add(tokenizer.convert_tokens_to_ids(image_token))
    return LoadedVLM(
        model=model,
        processor=processor,
        image_token=image_token,
        special_ids=frozenset(special),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
    )


def model_inputs(batch: Any) -> dict[str, Tensor]:
    """The tensors of a processor's output that are the model's inputs: all but ``labels``,
    which some processors return for training (PaliGemma's, from its ``token_type_ids``) and
    which would make the forward compute a loss over the prompt."""
    return {k: v for k, v in batch.items() if isinstance(v, Tensor) and k != "labels"}


def processor_inputs(processor: Any, images: Any, prompts: list[str]) -> dict[str, Tensor]:
    """The model inputs ``processor`` makes of uint8[B, H, W, 3] ``images`` and B
    ``prompts``, right-padded. ``padding_side`` is passed here, not only set on the tokenizer:
    some processors' call defaults pad left (Aya Vision's, InternVL's), which would put padding
    between a prompt and its actions."""
    batch = processor(
        images=pil_images(images),
        text=prompts,
        return_tensors="pt",
        padding=True,
        padding_side="right",
    )
    return model_inputs(batch)


def pil_images(images: Any) -> list[list[Any]]:
    """uint8[B, H, W, 3] pixels -> one list of one PIL image per row: the image type every
    processor takes (Idefics2's refuses arrays; the others convert PIL images to the arrays
    they would have read)."""
    from PIL import Image

    return [[Image.fromarray(image)] for image in images]


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "policy.kind: token_vla needs the models extra (pip install 'rlvla3[models]')"
        ) from None
    return transformers


def _load(auto_class: Any, directory: Path, what: str, **kwargs: Any) -> Any:
    try:
        return auto_class.from_pretrained(directory, local_files_only=True, **kwargs)
    # ImportError: a part the directory names needs a library that is not installed (a video
    # processor without torchvision)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = f"{_FIELD}: cannot load {what} from {str(directory)!r}: {first_line}"
        raise ConfigError(message) from None


def _untie_output_embeddings(model: nn.Module) -> None:
    """Give the output embedding its own copy of tied input embeddings. The weight path
    (transport/weights.py) binds every tensor to its own slice of one flat buffer and refuses
    tensors that share storage; fine-tuning the two apart is what an untied model does."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or inputs is None:
        return
    if output.weight.data_ptr() == inputs.weight.data_ptr():
        output.weight = nn.Parameter(output.weight.detach().clone())
        model.config.tie_word_embeddings = False
        text_config = model.config.get_text_config()
        text_config.tie_word_embeddings = False
