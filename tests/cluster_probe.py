"""A stranger on the cluster network: tries the run's Redis and sockets without the secret.

Run inside a node's network namespace by the cluster tests:
``python -m tests.cluster_probe REDIS_URL ENDPOINT``. Prints one JSON object saying what each
attempt got: the run must refuse them all.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import redis
import zmq

from transport.codec import Codec
from transport.messages import ObsRequest

_WAIT_MS = 3000


def redis_without_password(url: str, **options: object) -> str:
    """ "refused" when the server takes no command: it wants AUTH, or (a TLS-only port spoken
    to in plain text, a certificate not trusted) hangs up."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=5, **options).get("x")
    except redis.AuthenticationError:
        return "refused"
    except redis.ConnectionError:
        return "refused"
    except redis.ResponseError as err:
        return "refused" if "NOAUTH" in str(err) else f"error: {err}"
    return "served"


def zmq_request(endpoint: str, keys: tuple[bytes, bytes, bytes] | None) -> str:
    """Send an observation request as a DEALER (plain, or CURVE with ``keys``: server public,
    client public, client secret); "no reply" when the server never answers."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(endpoint)
    request = ObsRequest(env_key="0/0", request_id=1, obs={"state": np.zeros(4, np.float32)})
    try:  # never block: a refused peer may have no pipe to queue into
        sock.send_multipart(Codec().encode(request), flags=zmq.NOBLOCK)
        answered = sock.poll(_WAIT_MS)
    except zmq.Again:
        answered = False
    ctx.destroy(linger=0)
    return "served" if answered else "no reply"


def main() -> None:
    url, endpoint = sys.argv[1], sys.argv[2]
    server_public = sys.argv[3].encode() if len(sys.argv) > 3 else None
    tls_url = url.replace("redis://", "rediss://")
    result = {
        "redis": redis_without_password(url),
        # TLS trusting any certificate: past the handshake, the default user is off
        "redis_tls": redis_without_password(tls_url, ssl_cert_reqs="none"),
        "zmq_plain": zmq_request(endpoint, None),
    }
    if server_public is not None:
        public, secret = zmq.curve_keypair()  # a key pair of its own, not the run's
        result["zmq_wrong_key"] = zmq_request(endpoint, (server_public, public, secret))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
