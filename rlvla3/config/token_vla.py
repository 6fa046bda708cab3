"""``TokenVLAConfig``, the type of ``policy.token_vla``: a pretrained image-text-to-text model
from a local directory, acting through action tokens (rlvla3/policy/token_vla.py).

Kept apart from the model so that the run config can check it without importing torch or
``transformers``. What only the model directory or the env can tell (is it an image-text-to-text
model, does the env have the mapped keys, can its action space be binned) is checked when the
policy is built (``rlvla3.policy.factory``), each as one ``ConfigError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlvla3.config.typed_load import bounded

ModelDType = Literal["float32", "bfloat16"]

DEFAULT_PROMPT = "In: What action should the robot take to {instruction}?{state}\nOut:"
"""OpenVLA's prompt, with the state (when one is mapped) after the question."""

PROMPT_FIELDS = ("instruction", "state", "image")
"""The placeholders a prompt template may use."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ObservationMapping:
    """Which observation keys feed the model: the camera image, the instruction and an optional
    state vector (the defaults are the table-top task's keys)."""

    image: str = "image"
    """The camera: an observation of uint8[H, W, 3] pixels."""
    instruction: str = "instruction"
    """The instruction: byte tokens int[L] (UTF-8 bytes + 1, 0 = pad; sim/tokenizer.py), decoded back to text for the model's own tokenizer."""
    state: str | None = "proprio"
    """A float[P] state written into the prompt as text (``{state}``: `` State: 0.120 -0.500``, ``state_decimals`` decimals each); null: no state."""
    critic: str | None = None
    """A float[N] observation the value head reads beside the last prompt token's hidden state, and the policy never does: an asymmetric critic on the simulator's privileged state (the table-top's ``obs_mode: rgb+state`` key ``state``); null: the hidden state only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PresetGrounding:
    """Stage 0 for a size preset on the table-top task (rlvla3/policy/grounding.py): after
    ``rlvla3 launch`` writes the random-init preset, it trains it on rendered frames to find
    the blocks and targets, as a pretrained model's own pretraining would have, then saves it
    back. Labels come from the env's privileged object positions; no action is shown. Both steps
    0 (the default): the preset stays random-init."""

    vision_steps: int = bounded(0, ge=0)
    """Steps of the vision stage: a linear head on each image token learns which objects lie in its patch and where (trains the vision tower)."""
    text_steps: int = bounded(0, ge=0)
    """Steps of the text stage: the whole model answers `` red block?`` with `` 0.3 -0.5`` for every block and target of a frame."""
    frames: int = bounded(4000, ge=8)
    """Rendered frames (an episode's start plus up to 6 random pusher moves); 200 of them (at most a quarter) are held out to measure the stages."""
    batch_size: int = bounded(64, ge=1)
    """Frames per step."""
    lr: float = bounded(1e-3, gt=0)
    """AdamW learning rate of both stages."""
    seed: int = 0
    """Seed of the frames, the batches and the head."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConfig:
    """Plan tokens, an embodied chain of thought in action tokens: before its action tokens
    each call decodes ``dims`` plan tokens, values binned as actions are (the action tokens'
    ``bins``, uniform between ``low`` and ``high``), which the env never sees. SFT teaches them
    the observation ``key`` of the demos (the table-top's ``obs_mode: rgb+goal`` key ``goal``:
    the named block's and target's positions), so the action tokens that follow read what the
    model said it saw. They are decoded greedily, and the log-prob and entropy cover the action
    tokens alone, unless ``sampled``. docs/models.md, Plan tokens."""

    key: str = "goal"
    """The demos' observation of float[``dims``] values the plan tokens are taught to say (only SFT reads it)."""
    dims: int = bounded(4, ge=1)
    """Plan tokens per call, one per value of ``key``."""
    low: float = -1.0
    """Lower bin edge of every plan value."""
    high: float = 1.0
    """Upper bin edge of every plan value."""
    rl_coef: float = bounded(0.0, ge=0)
    """During RL, the weight of the plan tokens' loss against the observations' ``key`` when they have it (privileged labels for training only, as an asymmetric critic's state; the env's ``obs_mode: rgb+goal``): it holds the plan to what SFT taught while PPO moves the model. 0: RL leaves the plan to PPO."""
    sampled: bool = False
    """Sample the plan tokens as the actions are, their log-probs part of the action's, so that RL trains them by the return too; false: argmax always, the actions conditioned on the model's best reading and RL training the action tokens alone."""

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"low: must be below high, got {self.low} and {self.high}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenVLAConfig:
    """A pretrained vision-language model as a policy, the OpenVLA recipe: each action dimension
    is one token among the model's last ``bins`` non-special vocabulary ids (docs/models.md)."""

    path: str = ""
    """The model's directory (``config.json``, weights, processor and tokenizer files, as ``save_pretrained`` writes them); loaded with ``local_files_only``: nothing is fetched."""
    preset: str | None = None
    """A size preset of ``rlvla3/policy/presets.py`` (``llava-tiny``, ``idefics3-test``...): when ``path`` holds no model (no ``config.json``), ``rlvla3 launch`` first writes that preset's random-init checkpoint there (nothing fetched); null: ``path`` must hold a model."""
    preset_grounding: PresetGrounding = field(default_factory=PresetGrounding)
    """Stage 0 for a written ``preset`` on the table-top task: train it to find the blocks and targets before SFT (the learning run; docs/models.md). Runs only when ``rlvla3 launch`` writes the preset."""
    bins: int = bounded(256, ge=2)
    """Bins per continuous action dimension (uniform between ``action_low`` and ``action_high``). A discrete action space uses one token per action instead."""
    action_low: list[float] | None = None
    """Lower bin edge per action dimension (one value: every dimension); null: the env's action space's low."""
    action_high: list[float] | None = None
    """Upper bin edge per action dimension (one value: every dimension); null: the env's action space's high."""
    prompt: str = DEFAULT_PROMPT
    """Prompt template with ``{instruction}`` and optionally ``{state}`` and ``{image}`` (where the model's image token goes; without it, in front of the prompt). After the instruction, the image's tokens attend to it: a causal language model then reads the image already knowing what it is asked."""
    state_decimals: int = bounded(3, ge=0, le=8)
    """Decimals of each state value in the prompt."""
    state_projector: int = bounded(0, ge=0)
    """Hidden units of a state projector (OpenVLA-OFT's proprio projector): an MLP that maps ``observation.state`` to one embedding added to the prompt's last token, in place of the state as text (``{state}`` is then left empty and may be left out of the prompt). 0: the state is text."""
    observation: ObservationMapping = field(default_factory=ObservationMapping)
    """Which observation keys feed the image, the instruction and the state."""
    dtype: ModelDType = "float32"
    """The model's weights: ``float32`` or ``bfloat16``. The weight path carries float32 values (exact for bfloat16 ones; a rollout server copies them into its bfloat16 model once a version passed its checks), so a full bfloat16 model's versions travel at twice its size; with ``policy.lora`` only the float32 adapters and heads travel. The value head is float32 always."""
    gradient_checkpointing: bool = False
    """Recompute the model's activations in the backward pass (less memory, more time)."""
    value_hidden: int = bounded(256, ge=0)
    """Hidden units of the MLP value head on the last prompt token's hidden state (0: a linear head)."""
    detach_value: bool = False
    """Train the value head on a detached copy of that hidden state: the critic's loss does not move the model, only the policy's does (a critic that cannot yet predict returns then adds no noise to the features the actions read)."""
    temperature: float = bounded(1.0, gt=0)
    """Divides the action tokens' logits: the sampled actions, their log-probs and entropy are those of ``softmax(logits / temperature)``, in rollouts and in training alike; greedy actions do not change. Below 1 it narrows the spread that behaviour cloning fit to noisy demos, as a Gaussian policy's ``algo.init_log_std`` does."""
    plan: PlanConfig | None = None
    """Plan tokens before the action tokens of each call (null: none); ``action_steps`` 1 only."""
    action_steps: int = bounded(1, ge=1)
    """Env steps per policy call (an action chunk, OpenVLA-OFT style): each call decodes ``action_steps`` x D action tokens, the env worker executes the steps in order (the rest dropped at an episode's end), and the call is one transition whose reward is the executed steps' sum (docs/models.md, Action chunks). 1: one step per call."""

    @property
    def text_state(self) -> str | None:
        """The observation written into the prompt as text (``{state}``): the mapped state,
        unless the state projector takes it."""
        return None if self.state_projector else self.observation.state

    def __post_init__(self) -> None:
        if "{instruction}" not in self.prompt:
            raise ValueError(f"prompt: must contain {{instruction}}, got {self.prompt!r}")
        try:
            self.prompt.format(**dict.fromkeys(PROMPT_FIELDS, ""))
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"prompt: only {{instruction}}, {{state}} and {{image}} may be used ({err!r})"
            ) from None
        if self.prompt.count("{image}") > 1:
            raise ValueError(f"prompt: {{image}} may appear once, got {self.prompt!r}")
        if self.text_state is not None and "{state}" not in self.prompt:
            raise ValueError("prompt: a mapped observation.state needs {state} in the prompt")
        if self.state_projector and self.observation.state is None:
            raise ValueError("state_projector: it projects observation.state, which is null")
        if self.plan is not None and self.action_steps != 1:
            raise ValueError("plan: plan tokens need action_steps 1 (one plan per env step)")
