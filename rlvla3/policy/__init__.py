"""Policies: the ``ActorCritic`` interface (``base``), an MLP for classic control (``mlp``), the
VLA transformer (``vla``), its one attention function (``attention``) and tokenizer. Import the
submodules directly; this package imports nothing so that light users (the tokenizer in env
workers) do not pay for torch."""
