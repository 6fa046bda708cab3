"""A small vision-language-action transformer, built from scratch (no downloads).

One sample becomes one token sequence (a *document*)::

    [CLS] [proprio] [keypoints] [patch_0 ... patch_{N-1}] [instr_0 ... instr_{n-1}]

- ``CLS``: a learned vector; its final hidden state feeds the action and value heads.
- ``proprio``: ``Linear(proprio_dim, d_model)`` of the proprioceptive state (absent if dim 0).
- ``keypoints``: the keypoint stem's token (absent if ``keypoints`` is 0).
- patches: a ``Conv2d`` patch embedding of the uint8 image, scaled to [-1, 1].
- instruction: one token per real byte (``instruction_tokens: bytes``) or per word (``words``,
  ~5x fewer tokens); see rlvla3/policy/instruction.py.

Each modality has its own learned position table, which doubles as its type embedding. With
``film: true`` the patch embeddings are scaled and shifted per channel by a function of the pooled
instruction (FiLM, as in RT-1), so what an image token says already depends on what was asked.
With ``keypoints: K`` a small conv stem adds one token after proprio holding K spatial-softmax
(x, y) keypoints, FiLM-conditioned too when ``film`` is on (rlvla3/policy/keypoints.py).

**Padding.** Instruction pad tokens (id 0) are dropped, not masked: every sample's real tokens are
packed end to end and the trunk (rlvla3/policy/transformer.py) runs in the variable-length form of
``attention()`` with ``cu_seqlens``. Reasons: (1) it is exactly the path the SFT trainer uses for
packed demonstrations, so RL and SFT share one trunk code path and one set of numerics; (2) the
linears never compute on pad tokens; (3) on GPU it is one ``flash_attn_varlen_func`` call, which
has no mask argument anyway; (4) an output can never depend on the amount of padding. On CPU it
costs one batched SDPA call per distinct instruction length (one call when all instructions have
the same length).
The padded form (``trunk_padded`` with a key padding mask) is what the tests compare the packed one with.

Action heads (``VLAConfig.action_head``):

- ``"discrete_bins"``: OpenVLA-style, each of ``action_dim`` dimensions is a categorical over
  ``num_bins`` uniform bins of ``[action_low, action_high]``; action int64[B, D]; decode with
  ``bins_to_continuous`` (bin centres).
- ``"gaussian"``: diagonal Normal, mean from the CLS state, state-independent log-std;
  action float32[B, D].
- ``"categorical"``: one categorical over ``num_actions`` for discrete gym envs; action int64[B].
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Normal

from rlvla3.config.vla import VLAConfig
from rlvla3.policy.base import ActionSpec, ActorCritic, ActOutput, EvalOutput, ObsBatch
from rlvla3.policy.instruction import FiLM, InstructionEncoder
from rlvla3.policy.keypoints import KeypointStem
from rlvla3.policy.transformer import Transformer, init_weights


def bins_to_continuous(bins: Tensor, *, low: float, high: float, num_bins: int) -> Tensor:
    """Bin indices int64[...] -> float32[...] centres of ``num_bins`` equal bins of [low, high]."""
    width = (high - low) / num_bins
    return (low + (bins.to(torch.float32) + 0.5) * width).to(torch.float32)


def continuous_to_bins(values: Tensor, *, low: float, high: float, num_bins: int) -> Tensor:
    """Float values[...] -> int64[...] bin indices; values beyond [low, high] go to the end bins."""
    width = (high - low) / num_bins
    idx = torch.floor((values.to(torch.float64) - low) / width)
    return idx.clamp(0, num_bins - 1).to(torch.int64)


class VLAPolicy(ActorCritic):
    """Image + instruction + proprio -> action distribution and value (see module docstring).

    Observations: ``{"image": uint8[B, S, S, C], "instruction": int[B, L] (0 = pad, L <=
    max_instruction_len), "proprio": float32[B, P]}``; tensors may live on any device.
    """

    def __init__(self, config: VLAConfig) -> None:
        """``config``'s fields left to the env take their values without one (``resolved``)."""
        super().__init__()
        self.config = c = config.resolved({})
        d = c.d_model
        self.patch_embed = nn.Conv2d(c.channels, d, kernel_size=c.patch_size, stride=c.patch_size)
        self.instruction = InstructionEncoder(c.instruction_tokens, d, c.max_instruction_len)
        self.film = FiLM(d) if c.film else None
        self.keypoint_stem = (
            KeypointStem(c.channels, c.stem_channels, c.keypoints, d, c.film)
            if c.keypoints
            else None
        )
        self.proprio_embed = nn.Linear(c.proprio_dim, d) if c.proprio_dim > 0 else None
        self.cls_token = nn.Parameter(torch.zeros(d))
        self.image_pos = nn.Parameter(torch.zeros(c.num_patches, d))
        self.transformer = Transformer(
            d_model=d,
            num_layers=c.num_layers,
            num_heads=c.num_heads,
            mlp_ratio=c.mlp_ratio,
            dropout=c.dropout,
        )
        out = {
            "discrete_bins": c.action_dim * c.num_bins,
            "gaussian": c.action_dim,
            "categorical": c.num_actions,
        }[c.action_head]
        self.action_head = nn.Linear(d, out)
        self.log_std = (
            nn.Parameter(torch.full((c.action_dim,), c.init_log_std))
            if c.action_head == "gaussian"
            else None
        )
        self.value_head: nn.Module = (
            nn.Sequential(nn.Linear(d, c.value_hidden), nn.Tanh(), nn.Linear(c.value_hidden, 1))
            if c.value_hidden
            else nn.Linear(d, 1)
        )
        for module in (self.patch_embed, self.proprio_embed):
            if module is not None:
                init_weights(module)
        self.value_head.apply(init_weights)
        nn.init.normal_(self.cls_token, std=0.02)
        # Unit-scale image positions: at std 0.02 they were 3-7x smaller than the patch content
        # embedding, so after the pre-norm LayerNorm every patch token said *what* it showed but
        # hardly *where*, and locating an object stalled on a plateau of several hundred steps.
        nn.init.normal_(self.image_pos, std=1.0)
        nn.init.normal_(self.action_head.weight, std=0.01)  # near-uniform initial policy
        nn.init.zeros_(self.action_head.bias)

    # ----------------------------------------------------------------------------- tokens, trunk
    def embed(self, obs: ObsBatch) -> tuple[Tensor, Tensor, int]:
        """Observations -> packed tokens with pad tokens dropped.

        Returns:
            tokens: float[T, d_model], sample ``i``'s tokens at ``cu_seqlens[i]:cu_seqlens[i+1]``,
                its CLS token first.
            cu_seqlens: int32[B + 1] on the model's device.
            max_seqlen: an upper bound on the longest sample (fixed tokens + L; no host sync).
        """
        image, instr, proprio = self._check_obs(obs)
        b, d = image.shape[0], self.config.d_model
        pixels = image.permute(0, 3, 1, 2).to(self.cls_token.dtype) * (2.0 / 255.0) - 1.0
        patches = self.patch_embed(pixels).flatten(2).transpose(1, 2)  # [B, N, d]
        instr_tokens, real = self.instruction(instr)  # [B, L, d], bool[B, L]
        if self.film is not None:
            patches = self.film(patches, instr_tokens, real)
        parts = [self.cls_token.expand(b, 1, d)]
        if self.proprio_embed is not None:
            parts.append(self.proprio_embed(proprio)[:, None])
        if self.keypoint_stem is not None:
            parts.append(self.keypoint_stem(pixels, instr_tokens, real)[:, None])
        parts += [patches + self.image_pos, instr_tokens]
        seq = torch.cat(parts, dim=1)  # [B, F + L, d]
        fixed = torch.ones(b, seq.shape[1] - instr.shape[1], dtype=torch.bool, device=seq.device)
        keep = torch.cat([fixed, real], dim=1)  # [B, F + L]
        cu_seqlens = torch.zeros(b + 1, dtype=torch.int32, device=seq.device)
        cu_seqlens[1:] = keep.sum(1).cumsum(0)
        return seq[keep], cu_seqlens, seq.shape[1]

    def trunk(self, tokens: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Packed float[T, d_model] tokens (documents at ``cu_seqlens``) -> float[T, d_model]."""
        return self.transformer(tokens, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

    def trunk_padded(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Run padded float[B, L, d_model] tokens (mask bool[B, L], True = real) -> same shape."""
        return self.transformer(tokens, key_padding_mask=key_padding_mask)

    def features(self, obs: ObsBatch) -> Tensor:
        """Final CLS hidden state of each sample: float[B, d_model]."""
        tokens, cu_seqlens, max_seqlen = self.embed(obs)
        cls_rows = cu_seqlens[:-1].long()
        return self.transformer(
            tokens, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, out_rows=cls_rows
        )

    # ----------------------------------------------------------------------------- heads
    def distribution(self, obs: ObsBatch) -> tuple[Distribution, Tensor]:
        """Action distribution and value float32[B].

        The distribution's batch shape is [B, D] for the bins and Gaussian heads (sum log-probs
        over the last dim) and [B] for the categorical head.
        """
        feat = self.features(obs)
        value = self.value_head(feat.detach() if self.config.detach_value else feat).squeeze(-1)
        c = self.config
        out = self.action_head(feat)
        if c.action_head == "discrete_bins":
            dist = Categorical(logits=out.view(-1, c.action_dim, c.num_bins), validate_args=False)
        elif c.action_head == "gaussian":
            assert self.log_std is not None
            dist = Normal(out, self.log_std.exp().expand_as(out), validate_args=False)
        else:
            dist = Categorical(logits=out, validate_args=False)
        return dist, value

    def _reduce(self, per_dim: Tensor) -> Tensor:
        """Sum a per-dimension quantity over action dims (bins/Gaussian) -> float32[B]."""
        return per_dim if self.config.action_head == "categorical" else per_dim.sum(-1)

    @torch.no_grad()
    def act(self, obs: ObsBatch, deterministic: bool = False) -> ActOutput:
        """Sample (or, if ``deterministic``, take the mode of) one action per observation.

        Runs without autograd; re-score with ``evaluate`` for gradients. Action dtype/shape:
        int64[B, D] (bins), float32[B, D] (Gaussian), int64[B] (categorical).
        """
        dist, value = self.distribution(obs)
        action = dist.mode if deterministic else dist.sample()
        return ActOutput(action=action, log_prob=self._reduce(dist.log_prob(action)), value=value)

    def value_parameters(self) -> list[nn.Parameter]:
        """The value head's parameters (the trunk is shared with the action head)."""
        return list(self.value_head.parameters())

    def head_parameter_prefixes(self) -> tuple[str, ...]:
        """The action head (and the Gaussian's log-std) and the value head."""
        return ("action_head", "log_std", "value_head")

    def evaluate(self, obs: ObsBatch, action: Tensor) -> EvalOutput:
        """Log-prob float32[B], entropy float32[B] and value float32[B] of given actions."""
        dist, value = self.distribution(obs)
        action = action.to(value.device)
        expected = tuple(dist.batch_shape)
        if tuple(action.shape) != expected:
            raise ValueError(f"action shape {tuple(action.shape)} != expected {expected}")
        return EvalOutput(
            log_prob=self._reduce(dist.log_prob(action)),
            entropy=self._reduce(dist.entropy()),
            value=value,
        )

    def action_spec(self) -> ActionSpec:
        """Bin indices ``int64[D]`` in ``[0, num_bins)``, Gaussian ``float32[D]``, or one
        categorical index in ``[0, num_actions)``."""
        c = self.config
        if c.action_head == "discrete_bins":
            return ActionSpec((c.action_dim,), num_choices=c.num_bins)
        if c.action_head == "gaussian":
            return ActionSpec((c.action_dim,))
        return ActionSpec((), num_choices=c.num_actions)

    def to_env_action(self, action: Tensor) -> Tensor:
        """Policy action -> what the env steps with: bin centres float32[B, D] (bins head),
        the Gaussian sample clipped to [action_low, action_high], or the int64[B] index."""
        c = self.config
        if c.action_head == "discrete_bins":
            return bins_to_continuous(
                action, low=c.action_low, high=c.action_high, num_bins=c.num_bins
            )
        if c.action_head == "gaussian":
            return action.clamp(c.action_low, c.action_high)
        return action

    def from_env_action(self, env_action: Tensor) -> Tensor:
        """Env action -> policy action: bin indices int64[B, D] (bins head), else unchanged."""
        c = self.config
        if c.action_head == "discrete_bins":
            return continuous_to_bins(
                env_action, low=c.action_low, high=c.action_high, num_bins=c.num_bins
            )
        if c.action_head == "categorical":
            return env_action.long()
        return env_action.float()

    # ----------------------------------------------------------------------------- checks
    def _check_obs(self, obs: ObsBatch) -> tuple[Tensor, Tensor, Tensor | None]:
        """Validate and move (image uint8[B,S,S,C], instruction int64[B,L], proprio f[B,P])."""
        c, device = self.config, self.cls_token.device
        image = obs["image"].to(device)
        want = (c.image_size, c.image_size, c.channels)
        if image.dtype != torch.uint8 or image.dim() != 4 or tuple(image.shape[1:]) != want:
            raise ValueError(
                f"obs['image'] must be uint8[B, {want[0]}, {want[1]}, {want[2]}], "
                f"got {image.dtype}{list(image.shape)}"
            )
        b = image.shape[0]
        instr = obs["instruction"].to(device=device, dtype=torch.int64)
        if instr.dim() != 2 or instr.shape[0] != b or instr.shape[1] > c.max_instruction_len:
            raise ValueError(
                f"obs['instruction'] must be int[{b}, <={c.max_instruction_len}], "
                f"got {list(instr.shape)}"
            )
        if c.proprio_dim == 0:
            return image, instr, None
        proprio = obs["proprio"].to(device=device, dtype=self.cls_token.dtype)
        if tuple(proprio.shape) != (b, c.proprio_dim):
            raise ValueError(
                f"obs['proprio'] must be float[{b}, {c.proprio_dim}], got {list(proprio.shape)}"
            )
        return image, instr, proprio
