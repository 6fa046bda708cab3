"""Echo servers: what a request-reply round trip costs without the rollout server around it.

Each runs in a process of its own (``echo_server``): ``raw_echo_server`` is a plain pyzmq ROUTER
answering with pre-built bytes (no codec, no model: the limit of the socket), and
``codec_echo_server`` our ROUTER socket and codec, with or without the CartPole policy acting as
the rollout server's ``_serve`` does.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import zmq

from rlvla3.config.run_config import config_from_dict
from transport import sockets
from transport.messages import ActionReply

from .wire_messages import HOST, reply_frames

CARTPOLE_HIDDEN = (64, 64)
"""Hidden sizes of the CartPole MLP policy the servers act with."""
_CTX = mp.get_context("forkserver")  # children fork from one process that imported torch


def cartpole_policy() -> Any:
    """The CartPole MLP policy (``CARTPOLE_HIDDEN``), as the launcher builds it."""
    from rlvla3.policy.factory import build_policy

    return build_policy(config_from_dict({"policy": {"hidden_sizes": list(CARTPOLE_HIDDEN)}}))


def raw_echo_server(addresses: Any) -> None:
    """Process entry: a plain ROUTER answering every request with pre-built reply bytes."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    addresses.put(f"tcp://{HOST}:{sock.bind_to_random_port(f'tcp://{HOST}')}")
    reply = reply_frames()
    while True:
        identity, *_ = sock.recv_multipart()
        sock.send_multipart([identity, *reply])


def codec_echo_server(addresses: Any, with_policy: bool) -> None:
    """Process entry: our ROUTER socket and codec answering every ``ObsRequest``; with
    ``with_policy``, acting as ``_serve`` does (stack, the policy's numpy path, floats)."""
    torch.set_num_threads(1)
    sock = sockets.RouterSocket()
    addresses.put(sock.bind(HOST))
    policy = cartpole_policy() if with_policy else None
    rng = np.random.default_rng(0)
    action, log_prob, value = np.array(1, np.int64), -0.69, 0.5
    while True:
        got = sock.recv_from(timeout_s=0.1)
        if got is None:
            continue
        identity, req = got
        if policy is not None:
            out = policy.act_numpy({"state": np.array([req.obs["state"]])}, False, rng)
            action, log_prob, value = out.action[0], out.log_prob.tolist()[0], out.value.tolist()[0]
        reply = ActionReply(
            request_id=req.request_id,
            action=np.asarray(action),
            env_action=None,
            log_prob=log_prob,
            value=value,
            policy_version=0,
        )
        sock.send_to(identity, reply)


@contextlib.contextmanager
def echo_server(target: Any, *args: Any) -> Iterator[tuple[str, int]]:
    """An echo server (``target(addresses, *args)``) in its own process; yields its address
    and pid."""
    addresses = _CTX.Queue()
    server = _CTX.Process(target=target, args=(addresses, *args), daemon=True)
    server.start()
    try:
        yield addresses.get(timeout=60), server.pid
    finally:
        server.terminate()
        server.join(timeout=10)
