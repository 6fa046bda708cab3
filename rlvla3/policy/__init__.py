"""Policies: the ``ActorCritic`` interface (``base``), an MLP for classic control (``mlp``), the
VLA transformer (``vla``) and its one attention function (``attention``). Import the submodules
directly; this package imports nothing, so that importing one submodule does not pay for the
others. (Instructions are tokenized by ``sim.tokenizer``: envs produce the tokens.)"""
