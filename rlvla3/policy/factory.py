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
    """The policy ``cfg.policy`` describes, shaped for the env's spaces, with the same initial
    weights in every role (``initial_policy``); with ``policy.lora``, its adapters on the base
    that ``base_policy`` builds."""
    env = env or env_spaces(cfg)
    if not cfg.policy.lora.enabled:
        return initial_policy(cfg, env)
    from rlvla3.policy.lora import apply_lora

    policy = base_policy(cfg, env)
    apply_lora(policy, cfg.policy.lora)
    return policy


def initial_policy(cfg: Config, env: EnvSpaces) -> ActorCritic:
    """The policy of ``policy.kind``, its initial weights drawn from ``run.seed`` on a forked
    generator: every role and process draws the same ones (a LoRA policy's frozen base must be
    alike everywhere, since only the adapters and heads travel), and the caller's own random
    stream is left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        return _family(cfg, env)


def base_policy(cfg: Config, env: EnvSpaces | None = None) -> ActorCritic:
    """The policy without adapters, with the weights of a LoRA policy's frozen base:
    ``initial_policy``'s, then ``policy.init_checkpoint``'s, if set."""
    env = env or env_spaces(cfg)
    policy = initial_policy(cfg, env)
    if cfg.policy.init_checkpoint:
        from rlvla3.policy.lora import load_init_weights

        load_init_weights(policy, cfg.policy.init_checkpoint)
    return policy


def check_lora_targets(cfg: Config) -> None:
    """``policy.lora.target_modules`` against the policy's module names, before any role
    starts (the launcher's check): the policy is built on the meta device, without weights. A
    family that cannot be built there is left to the roles, which check the same when they
    build it.

    Raises:
        ConfigError: a target names no adaptable module (``rlvla3.policy.lora``).
    """
    if not cfg.policy.lora.enabled:
        return
    import torch

    from rlvla3.policy.lora import adapted_module_names

    env = env_spaces(cfg)
    try:
        with torch.device("meta"):
            policy = _family(cfg, env)
    except ConfigError:
        raise
    except Exception:  # e.g. a loader that reads real tensors: the roles will check
        return
    adapted_module_names(policy, cfg.policy.lora.target_modules, policy.head_parameter_prefixes())


def _family(cfg: Config, env: EnvSpaces) -> ActorCritic:
    """The policy of ``policy.kind``, freshly initialised."""
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
