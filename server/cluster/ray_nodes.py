"""Where a Ray actor serves: its node's address in the cluster and a free port there."""

from __future__ import annotations

import socket

__all__ = ["free_port", "node_ip"]


def node_ip() -> str:
    """This node's address in the Ray cluster."""
    import ray

    return str(ray.util.get_node_ip_address())


def free_port(host: str) -> int:
    """A port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
