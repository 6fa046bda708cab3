"""rlvla3: asynchronous distributed RL for vision-language-action policies."""

__version__ = "0.1.0"
