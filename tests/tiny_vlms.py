"""The tests' tiny random-weight image-text-to-text checkpoints: the ``test`` size preset of
``rlvla3.policy.presets`` (LLaVA and Idefics3 / SmolVLM), written to a temp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlvla3.policy.presets import FAMILIES, IMAGE_SIZE, VOCAB_SIZE, byte_tokenizer, llama_config
from rlvla3.policy.presets import write_vlm as _write_vlm

__all__ = [
    "FAMILIES",
    "IMAGE_SIZE",
    "VOCAB_SIZE",
    "byte_tokenizer",
    "tabletop_run_config",
    "write_tiny_vlm",
]


def _llama(vocab_size: int):
    """The test preset's Llama text model (a text-only model the loader must refuse)."""
    return llama_config(vocab_size)


def write_tiny_vlm(
    directory: Path, family: str, *, vocab_size: int = VOCAB_SIZE, seed: int = 0
) -> Path:
    """Save a ``test``-size random-weight ``family`` model and its processor into ``directory``."""
    return _write_vlm(directory, family, "test", vocab_size=vocab_size, seed=seed)


def tabletop_run_config(name: str, redis_url: str, model_dir: Path, **token_vla: Any) -> dict:
    """A short RL run's YAML (env worker, rollout server, trainer, broadcaster; 160 env steps)
    of a token VLA in ``model_dir`` on the table-top task at the tiny processors' image size;
    ``token_vla``: more ``policy.token_vla`` keys."""
    return {
        "run": {
            "name": name,
            "redis_url": redis_url,
            "heartbeat_ttl_s": 5.0,
            "stop": {"max_env_steps": 160, "max_wall_s": 200},
        },
        "roles": {
            "env_worker": {"count": 1},
            "rollout_server": {"count": 1, "settings": {"max_batch": 4}},
            "trainer": {"count": 1},
            "weight_broadcaster": {"count": 1},
        },
        "env": {
            "id": "rlvla3/TableTopEasy-v0",
            "num_envs_per_worker": 2,
            "chunk_len": 8,
            "kwargs": {"image_size": IMAGE_SIZE, "instruction_max_len": 48},
        },
        "policy": {
            "kind": "token_vla",
            "token_vla": {"path": str(model_dir), "bins": 16, "value_hidden": 16, **token_vla},
        },
        "algo": {"batch_steps": 32, "minibatch_size": 16, "epochs": 1, "checkpoint_every": 2},
    }
