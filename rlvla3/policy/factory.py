"""Build the configured policy for the configured env (the same in every role)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gymnasium import spaces

from rlvla3.config.run_config import Config
from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.base import ActorCritic


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvSpaces:
    """The observation and action spaces of the configured env."""

    observation: spaces.Dict
    action: spaces.Space


def env_spaces(cfg: Config) -> EnvSpaces:
    """Read the spaces from one throw-away env instance."""
    from sim.envs import make_env

    env = make_env(cfg.env.id, seed=cfg.run.seed, **cfg.env.kwargs)
    try:
        return EnvSpaces(observation=env.observation_space, action=env.action_space)
    finally:
        env.close()


def build_policy(cfg: Config, env: EnvSpaces | None = None) -> ActorCritic:
    """The policy ``cfg.policy`` describes, shaped for the env's spaces."""
    env = env or env_spaces(cfg)
    if cfg.policy.kind == "mlp":
        from rlvla3.policy.mlp import MLPPolicy

        if "state" not in env.observation.spaces:
            raise ConfigError(
                f"policy.kind: mlp needs a 'state' observation; {cfg.env.id} has "
                f"{sorted(env.observation.spaces)} (use policy.kind: vla)"
            )
        obs_dim = int(env.observation["state"].shape[0])
        return MLPPolicy(obs_dim, env.action, tuple(cfg.policy.hidden_sizes))
    if cfg.policy.kind == "token_vla":
        from rlvla3.policy.token_vla import build_token_vla

        return build_token_vla(cfg.policy.token_vla, env.observation, env.action)
    from rlvla3.policy.vla import VLAPolicy

    try:
        vla = cfg.policy.vla.resolved(_vla_fields_from_spaces(env))
    except ValueError as err:  # the env's spaces do not fit what the YAML set
        raise ConfigError(f"policy.vla: {err}") from None
    return VLAPolicy(vla)


def _vla_fields_from_spaces(env: EnvSpaces) -> dict[str, Any]:
    obs = env.observation.spaces
    fields: dict[str, Any] = {}
    if "image" in obs:
        fields["image_size"] = int(obs["image"].shape[0])
        fields["channels"] = int(obs["image"].shape[2])
    if "instruction" in obs:
        fields["max_instruction_len"] = int(obs["instruction"].shape[0])
    fields["proprio_dim"] = int(obs["proprio"].shape[0]) if "proprio" in obs else 0
    if isinstance(env.action, spaces.Discrete):
        fields.update(action_head="categorical", num_actions=int(env.action.n))
    else:
        fields["action_dim"] = int(env.action.shape[0])
        fields["action_low"] = float(env.action.low.min())
        fields["action_high"] = float(env.action.high.max())
    return fields
