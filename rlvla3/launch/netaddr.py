"""Which address a node binds and advertises so that the other nodes of a run reach it.

ZeroMQ connects to an unreachable loopback endpoint without any error, so in a multi-node run
loopback is refused outright (``require_routable``), and an unset address is found as the one
of the interface that routes to the head node (``route_address``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class AddressError(RuntimeError):
    """A node has no address the other nodes can reach."""


def resolve(host: str) -> str:
    """The IPv4 address of ``host`` (a name or an address).

    Raises:
        AddressError: the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise AddressError(f"{host!r} does not resolve ({err.strerror})") from None
    return infos[0][4][0]


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def route_address(peer: str) -> str:
    """The local address of the interface this host would use to reach ``peer`` (an address).

    A UDP ``connect`` only asks the kernel's routing table; nothing is sent.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))
        except OSError as err:
            raise AddressError(f"no route to {peer} ({err.strerror})") from None
        return probe.getsockname()[0]


def require_routable(node: str, address: str, how: str) -> str:
    """``address`` if other hosts can reach it; else an error naming ``node`` and ``how`` the
    address was found."""
    if is_loopback(address) or ipaddress.ip_address(address).is_unspecified:
        raise AddressError(
            f"node {node!r}: {how} gives {address}, which other nodes cannot "
            "reach; set nodes[].host to its address on the cluster network"
        )
    return address


def require_bindable(address: str, how: str) -> str:
    """``address`` unless it is a wildcard (every interface), which a run never binds."""
    if ipaddress.ip_address(address).is_unspecified:
        raise AddressError(
            f"{how} gives {address}, a wildcard address (every interface); "
            "set nodes[].host to the node's own address"
        )
    return address


def interface_of(address: str) -> str | None:
    """The name of the local interface holding ``address`` (e.g. for ``NCCL_SOCKET_IFNAME``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None
