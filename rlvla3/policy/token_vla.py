"""A pretrained vision-language model as a policy: the OpenVLA recipe over any ``transformers``
image-text-to-text model (``policy.kind: token_vla``; docs/models.md).

One step's sequence is the processor's prompt (image tokens, the instruction, the state as
text) followed by D action tokens, one per action dimension. Action tokens are the model's
``bins`` highest non-special vocabulary ids (``rlvla3/policy/action_tokens.py``); each
dimension's distribution is the softmax over those ``bins`` logits alone, so log-probs are exact
and cheap, and the log-prob of an action is the sum over its D tokens.

- With ``action_steps`` K above 1 a call is an action chunk: K x D action tokens, step-major
  (step 0's D dimensions, then step 1's...), the action int64[B, K, D] (int64[B, D] for K = 1)
  and the log-prob the sum over all K x D tokens.
- With ``plan`` (an embodied chain of thought in action tokens) a call first decodes P plan
  tokens, binned values such as the named block's and target's positions, then the action
  tokens, which so read what the model said it saw: the action is int64[B, P + D], the env
  steps with its last D (``to_env_action``). The plan is decoded greedily and the log-prob and
  entropy cover the D action tokens (``plan.sampled``: all P + D tokens, the plan sampled).
  SFT teaches the plan the demos' ``plan.key`` observation (``demo_action``).
- With ``state_projector`` the state is no text in the prompt: an MLP maps it to one vector
  added to the input embedding of the prompt's last token (``state_added``;
  ``rlvla3/policy/state_projector.py``), in every forward over the prompts.
- ``temperature`` divides the action-token logits everywhere (sampling, log-probs, entropy), so
  the policy PPO trains is the one that acted; greedy actions do not depend on it.
- ``act`` decodes the tokens one at a time (greedy: argmax; ``rlvla3/policy/token_decode.py``:
  with the model's KV cache for LLaVA and Idefics3, a forward over the prompt and the tokens so
  far per token for other families). ``evaluate`` is one teacher-forced forward over the prompt
  and all the tokens. Both give each row's action tokens the positions right after its own
  (right-padded) prompt, so every real token keeps the position it has unpadded and attention
  never sees the padding: a row's log-probs do not depend on what it is batched with, and
  ``act``'s equal ``evaluate``'s (tested to 1e-4 in float32).
- The value head (float32, an MLP) reads the last hidden state of the last prompt token, the
  position from which the first action token is predicted, and, with ``observation.critic``
  mapped, that observation too (an asymmetric critic: privileged simulator state that only the
  value sees, so the actions still come from the camera, instruction and state alone).
- The processor's inputs are built by ``DeviceInputs`` (``rlvla3/policy/device_inputs.py``)
  where a probe at load shows it computes what the processor does: the pixels normalised in
  torch on the model's device, each prompt's tokens cached. Otherwise by the processor, on the
  CPU (the log says why), as are images of another size than the env's (demos recorded at
  another size).
- The model is a submodule (``self.model``), so ``state_dict``, checkpoints, the flat weight
  layout of the weight path and peft's ``target_modules`` (q_proj, v_proj...) see its tensors
  under their usual names.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from gymnasium import spaces
from torch import Tensor, nn
from torch.distributions import Categorical

from rlvla3.config.token_vla import TokenVLAConfig
from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.action_suffix import append_action_tokens
from rlvla3.policy.action_tokens import ActionBins, action_bins, action_token_ids
from rlvla3.policy.base import ActionSpec, ActorCritic, ActOutput, EvalOutput, ObsBatch
from rlvla3.policy.device_inputs import DeviceInputs, batch_inputs, probed
from rlvla3.policy.hf_model import LoadedVLM, load_vlm, resolve_dtype
from rlvla3.policy.state_projector import StateProjector, added_to_input_embeddings
from rlvla3.policy.token_decode import ActionDecoder
from rlvla3.policy.vla_prompt import PromptBuilder

_SUFFIX_TOKEN_TYPE = {"paligemma": 1}
"""The ``token_type_ids`` value of generated tokens, by model type (0 otherwise): PaliGemma
marks its prompt prefix 0 (attended both ways) and what follows 1 (causal), as its own
``generate`` extends them; with 0 the prompt would see the action tokens after it."""


class TokenVLAPolicy(ActorCritic):
    """Image + instruction (+ state) -> D action tokens of a pretrained VLM, and a value."""

    def __init__(
        self,
        vlm: LoadedVLM,
        config: TokenVLAConfig,
        bins: ActionBins,
        critic_dim: int = 0,
        state_dim: int = 0,
        device_inputs: DeviceInputs | None = None,
    ) -> None:
        """``critic_dim``: the size of the ``observation.critic`` vector (0: none mapped);
        ``state_dim``: the size of ``observation.state`` (the state projector's input);
        ``device_inputs``: the processor's shortcut (None: the processor builds every batch)."""
        super().__init__()
        self.config, self.bins = config, bins
        self.model = vlm.model
        self.processor = vlm.processor
        self.device_inputs = device_inputs
        self.pad_id = int(vlm.processor.tokenizer.pad_token_id or 0)
        self.prompt = PromptBuilder(config.prompt, vlm.image_token, config.state_decimals)
        ids = action_token_ids(vlm.vocab_size, bins.bins, vlm.special_ids)
        self.register_buffer("action_ids", torch.tensor(ids, dtype=torch.int64), persistent=False)
        self.suffix_token_type = _SUFFIX_TOKEN_TYPE.get(self.model.config.model_type, 0)
        self.keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        width = int(self.model.config.get_text_config().hidden_size)
        self.state_projector = (
            StateProjector(state_dim, config.state_projector, width)
            if config.state_projector
            else None
        )
        hidden = width + critic_dim
        h = config.value_hidden
        self.value_head = (
            nn.Sequential(nn.Linear(hidden, h), nn.Tanh(), nn.Linear(h, 1))
            if h
            else nn.Linear(hidden, 1)
        )
        plan = config.plan
        self.greedy_plan = plan.dims if plan is not None and not plan.sampled else 0
        """Leading tokens decoded by argmax and left out of log-probs and entropies."""
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})

    # ----------------------------------------------------------------------------- interface
    def action_spec(self) -> ActionSpec:
        """Bin indices int64[D] in ``[0, bins)``, or int64[K, D] for action chunks of K steps."""
        bins = self.bins
        return ActionSpec(bins.action_shape, num_choices=bins.bins, env_steps=bins.steps)

    @torch.no_grad()
    def act(self, obs: ObsBatch, deterministic: bool = False) -> ActOutput:
        """Decode K x D action tokens per observation (sampled, or argmax when
        ``deterministic``): action int64[B, D] (int64[B, K, D] for K > 1), log_prob float32[B]
        (summed over the tokens), value float32[B]."""
        inputs, lengths = self._prompt_inputs(obs)
        decoder = ActionDecoder(self.model, self.action_ids, self._score, self.config.temperature)
        with self.state_added(obs, lengths - 1):
            decoded = decoder.decode(
                inputs, lengths, self.bins.tokens, deterministic, greedy_first=self.greedy_plan
            )
        action = decoded.tokens.reshape(len(lengths), *self.bins.action_shape)
        value = self._value(decoded.last_hidden, obs)
        return ActOutput(action=action, log_prob=decoded.log_prob, value=value)

    def _value(self, last_hidden: Tensor, obs: ObsBatch) -> Tensor:
        """float32[B] from the last prompt token's hidden state (detached: ``detach_value``)
        and the ``observation.critic`` vector when one is mapped."""
        hidden = last_hidden.detach() if self.config.detach_value else last_hidden
        critic = self.config.observation.critic
        if critic is not None:
            if critic not in obs:  # e.g. SFT demos written without it
                raise ConfigError(
                    f"policy.token_vla.observation.critic: the observations have no {critic!r} "
                    f"(they have {sorted(obs)}; write demos with the env's obs_mode that has it)"
                )
            extra = torch.as_tensor(obs[critic], dtype=torch.float32, device=hidden.device)
            hidden = torch.cat([hidden, extra.reshape(len(hidden), -1)], -1)
        return self.value_head(hidden).squeeze(-1)

    def evaluate(self, obs: ObsBatch, action: Tensor) -> EvalOutput:
        """One teacher-forced forward: log-prob float32[B] and entropy float32[B] (each summed
        over the K x D tokens, a sampled plan's too) and value float32[B] of actions int64[B, D]
        (int64[B, K, D]); with ``plan.rl_coef`` and the observations holding ``plan.key``, the
        plan's loss against it as ``aux_loss``."""
        inputs, lengths = self._prompt_inputs(obs)
        tokens = self.action_tokens(action, lengths)
        plan = self.config.plan
        held = plan is not None and plan.rl_coef > 0 and plan.key in obs
        return self.evaluate_prompts(
            inputs,
            lengths,
            tokens,
            obs,
            first_scored=self.greedy_plan,
            plan_labels=self._plan_labels(obs, len(tokens)) if held else None,
        )

    def demo_evaluate(self, obs: ObsBatch, action: Tensor) -> EvalOutput:
        """``evaluate`` for SFT: a greedy plan's tokens are scored too (they are what the demos
        teach first)."""
        inputs, lengths = self._prompt_inputs(obs)
        return self.evaluate_prompts(inputs, lengths, self.action_tokens(action, lengths), obs)

    def evaluate_prompts(
        self,
        inputs: dict[str, Tensor],
        lengths: Tensor,
        tokens: Tensor,
        obs: ObsBatch,
        first_scored: int = 0,
        plan_labels: Tensor | None = None,
    ) -> EvalOutput:
        """``evaluate`` on prompts already processed (``_prompt_inputs``) and action tokens
        int64[B, K x D] (``action_tokens``), the log-prob and entropy summed over the tokens
        from ``first_scored`` on; with ``plan_labels`` int64[B, P] the plan tokens' loss against
        them (``plan.rl_coef``) as ``aux_loss``."""
        with self.state_added(obs, lengths - 1):
            logits, last_hidden = self._score(inputs, lengths, tokens)
        scored = slice(first_scored, tokens.shape[1])
        dist = Categorical(logits=logits[:, scored], validate_args=False)
        aux_loss = None
        if plan_labels is not None:
            # the plan positions' logits with the acted plan before them (teacher-forced as it
            # was decoded), which is what the action tokens read
            plan = Categorical(logits=logits[:, : plan_labels.shape[1]], validate_args=False)
            aux_loss = -self.config.plan.rl_coef * plan.log_prob(plan_labels).sum(-1)
        return EvalOutput(
            log_prob=dist.log_prob(tokens[:, scored]).sum(-1),
            entropy=dist.entropy().sum(-1),
            value=self._value(last_hidden, obs),
            aux_loss=aux_loss,
        )

    def action_tokens(self, action: Tensor, lengths: Tensor) -> Tensor:
        """Bin indices int64[B, D] (int64[B, K, D]) of a batch of ``len(lengths)`` prompts as
        int64[B, K x D] on the prompts' device, step-major as ``act`` decodes them.

        Raises:
            ValueError: the action's shape is not the policy's.
        """
        action = action.to(device=lengths.device, dtype=torch.int64)
        expected = (len(lengths), *self.bins.action_shape)
        if tuple(action.shape) != expected:
            raise ValueError(f"action shape {tuple(action.shape)} != expected {expected}")
        return action.reshape(len(lengths), -1)

    def value_parameters(self) -> list[nn.Parameter]:
        """The value head's parameters."""
        return list(self.value_head.parameters())

    def head_parameter_prefixes(self) -> tuple[str, ...]:
        """The value head and the state projector. The action tokens are the language model's
        own output layer, which LoRA leaves frozen (as OpenVLA's LoRA recipe does) and adapts
        through the layers below."""
        return ("value_head", "state_projector") if self.state_projector else ("value_head",)

    def to_env_action(self, action: Tensor) -> Tensor:
        """Bin indices -> bin centres float32[B, D] (or the discrete index int64[B]); an action
        chunk's float32[B, K, D] (int64[B, K])."""
        return self.bins.to_env(action)

    def from_env_action(self, env_action: Tensor) -> Tensor:
        """Env actions -> bin indices int64[B, D] (an action chunk's int64[B, K, D])."""
        return self.bins.from_env(env_action)

    def demo_action(self, obs: ObsBatch, env_action: Tensor) -> Tensor:
        """``from_env_action``, after the plan's bins of the frames' ``plan.key`` values."""
        action = self.from_env_action(env_action)
        if self.config.plan is None:
            return action
        return torch.cat([self._plan_labels(obs, len(action)), action], dim=-1)

    def _plan_labels(self, obs: ObsBatch, rows: int) -> Tensor:
        """The bins int64[B, P] of the observations' ``plan.key`` values, on the model's device.

        Raises:
            ConfigError: the observations have no ``plan.key``, or not ``plan.dims`` values.
        """
        plan = self.config.plan
        if plan.key not in obs:
            raise ConfigError(
                f"policy.token_vla.plan.key: the demos have no {plan.key!r} observation (they "
                f"have {sorted(obs)}; write them with the env's obs_mode that has it)"
            )
        values = torch.as_tensor(obs[plan.key], device=self.action_ids.device)
        values = values.reshape(rows, -1)
        if values.shape[1] != plan.dims:
            raise ConfigError(
                f"policy.token_vla.plan.dims: {plan.dims}, but the observations' {plan.key!r} "
                f"has {values.shape[1]} values"
            )
        return self.bins.plan_bins(values)

    # ----------------------------------------------------------------------------- the model
    def state_added(
        self, obs: ObsBatch, columns: Tensor, rows: Tensor | None = None
    ) -> AbstractContextManager:
        """While inside, the model's input embedding of each prompt's last token, at row
        ``rows[i]`` (default: row ``i``, the padded layout) and column ``columns[i]`` of the
        token ids, gets the state projector's embedding of observation ``i``'s state added
        (nothing without a projector)."""
        if self.state_projector is None:
            return nullcontext()
        device = self.action_ids.device
        rows = torch.arange(len(columns)) if rows is None else rows
        state = torch.as_tensor(obs[self.config.observation.state], device=device)
        vectors = self.state_projector(state)
        return added_to_input_embeddings(self.model, rows.to(device), columns, vectors)

    def _prompt_inputs(self, obs: ObsBatch) -> tuple[dict[str, Tensor], Tensor]:
        """The processor's inputs for the batch's prompts, on the model's device, and each
        prompt's length in tokens int64[B]."""
        mapping = self.config.observation
        image = obs[mapping.image]  # (to the model's device only where DeviceInputs takes it)
        text_state = self.config.text_state
        states = None if text_state is None else _numpy(obs[text_state])
        prompts = self.prompt.prompts(_numpy(obs[mapping.instruction]), states)
        device, dtype = self.action_ids.device, self.model.dtype
        batch = batch_inputs(self.processor, self.device_inputs, image, prompts, device)
        inputs = {
            key: value.to(device=device, dtype=dtype if value.is_floating_point() else None)
            for key, value in batch.items()
        }
        return inputs, inputs["attention_mask"].sum(1)

    def _score(
        self, inputs: dict[str, Tensor], lengths: Tensor, actions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One forward over the prompts followed by ``actions`` int64[B, k] (as tokens).

        Returns the action-token logits float32[B, k + 1, bins] that predict action tokens
        0..k (divided by ``temperature``), and the last hidden state of each prompt's last
        token float32[B, hidden].
        """
        b, k = actions.shape
        width = inputs["input_ids"].shape[1] + k
        extended = append_action_tokens(
            inputs,
            lengths,
            self.action_ids[actions],
            pad_id=self.pad_id,
            suffix_token_type=self.suffix_token_type,
        )
        # logits only from the first position any row needs on: a full vocabulary's logits at
        # every position would be most of a large model's activation memory
        first = int(lengths.min()) - 1
        kwargs = {"logits_to_keep": width - first} if self.keeps_logits else {}
        out = self.model(**extended, output_hidden_states=True, use_cache=False, **kwargs)
        offset = width - out.logits.shape[1]
        rows = lengths[:, None] - 1 + torch.arange(k + 1, device=lengths.device) - offset
        picked = out.logits[torch.arange(b, device=rows.device)[:, None], rows]  # [B, k+1, V]
        logits = picked[..., self.action_ids].float() / self.config.temperature
        last_hidden = out.hidden_states[-1][torch.arange(b, device=rows.device), lengths - 1]
        return logits, last_hidden.float()


def _numpy(value: Tensor | np.ndarray) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, Tensor) else np.asarray(value)


def build_token_vla(config: TokenVLAConfig, observation: spaces.Dict, action: spaces.Space):
    """The policy ``policy.token_vla`` describes, for an env with these spaces; every mismatch
    one ``ConfigError`` naming its field, before the model is loaded where it can be."""
    check_observation_mapping(config, observation)
    bins = action_bins(action, config)
    vlm = load_vlm(config.path, resolve_dtype(config.dtype))
    critic = config.observation.critic
    critic_dim = 0 if critic is None else int(np.prod(observation[critic].shape))
    state = config.observation.state
    state_dim = 0 if state is None else int(np.prod(observation[state].shape))
    image_shape = observation[config.observation.image].shape
    device_inputs = probed(vlm.processor, vlm.image_token, image_shape)
    return TokenVLAPolicy(vlm, config, bins, critic_dim, state_dim, device_inputs)


def check_observation_mapping(config: TokenVLAConfig, observation: spaces.Dict) -> None:
    """Every mapped key is in the env's observation space, the image uint8[H, W, 3], the
    critic's a float vector, and a plan held to its labels during RL (``plan.rl_coef``) finds
    them."""
    mapping, have = config.observation, observation.spaces
    plan = config.plan
    if plan is not None and plan.rl_coef > 0 and plan.key not in have:
        raise ConfigError(
            f"policy.token_vla.plan.rl_coef: {plan.rl_coef} holds the plan to the observation "
            f"{plan.key!r}, which the env does not have (it has {sorted(have)}; the table-top's "
            "obs_mode rgb+goal has 'goal')"
        )
    for name in ("image", "instruction", "state", "critic"):
        key = getattr(mapping, name)
        if key is not None and key not in have:
            raise ConfigError(
                f"policy.token_vla.observation.{name}: the env has no observation {key!r} "
                f"(it has {sorted(have)})"
            )
    image = have[mapping.image]
    if image.dtype != np.uint8 or len(image.shape) != 3 or image.shape[2] != 3:
        raise ConfigError(
            f"policy.token_vla.observation.image: {mapping.image!r} is {image.dtype}"
            f"{list(image.shape)}, not uint8[H, W, 3] pixels"
        )
    critic = None if mapping.critic is None else have[mapping.critic]
    if critic is not None and (
        not isinstance(critic, spaces.Box) or not np.issubdtype(critic.dtype, np.floating)
    ):
        raise ConfigError(
            f"policy.token_vla.observation.critic: {mapping.critic!r} is {critic}, not a float "
            "vector"
        )
