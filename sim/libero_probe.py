"""``python -m sim.libero_probe quick|full``: the child process of ``sim.libero_setup.probe``.

A separate process, because a missing config prompts on stdin and a broken GL driver can hang
or crash the interpreter; a separate module, because it needs both the setup and the adapter.
"""

from __future__ import annotations

import sys

import numpy as np

from sim.libero import LiberoAdapter, LiberoConfig
from sim.libero_setup import import_libero

_PROBE_XML = """<mujoco><worldbody><light pos="0 0 3"/><geom type="plane" size="1 1 .1"/>
<body pos="0 0 .2"><freejoint/><geom type="box" size=".1 .1 .1" rgba="1 0 0 1"/></body>
</worldbody></mujoco>"""


def probe_child(mode: str) -> None:
    """Import LIBERO and render (``quick``), or build and step one env (``full``); prints
    ``LIBERO_PROBE_OK`` when it worked."""
    if mode == "quick":
        import_libero()  # config, GL backend, libero + robosuite imports
        import mujoco

        model = mujoco.MjModel.from_xml_string(_PROBE_XML)
        data = mujoco.MjData(model)
        mujoco.mj_forward(model, data)
        renderer = mujoco.Renderer(model, 16, 16)
        renderer.update_scene(data)
        pixels = renderer.render()
        renderer.close()
        assert pixels.shape == (16, 16, 3) and pixels.any(), "MuJoCo rendered a black image"
    else:
        config = LiberoConfig(suite="libero_spatial", task_index=0, image_size=32)
        env = LiberoAdapter(config, seed=0)
        try:
            obs, _ = env.reset(seed=0)
            env.step(np.zeros(7, np.float32))
            assert env.observation_space.contains(obs), "observation outside observation_space"
        finally:
            env.close()
    print("LIBERO_PROBE_OK", flush=True)


if __name__ == "__main__":
    probe_child(sys.argv[1] if len(sys.argv) > 1 else "quick")
