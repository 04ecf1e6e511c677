"""A local multi-node Ray cluster for the bench and the tests: every node on loopback.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set before anything imports Ray
(``tests/conftest.py``, ``bench/ray_pool.py``), makes Ray take loopback as
this machine's address, so its servers listen on 127.0.0.1 only and
``ray.init(address=...)`` does not trade ``127.0.0.1`` for the machine's
network address. Ray's files (sockets, logs, the address of the latest
cluster) go to a private temporary directory removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import ray
from ray.cluster_utils import Cluster

#: Object store of each node: the least Ray accepts is 75 MiB; rollouts pass small objects.
STORE_BYTES = 80 * 1024 * 1024


def node_args(cpus: int) -> dict[str, Any]:
    """What each node of a test cluster is started with."""
    return {
        "num_cpus": cpus,
        "object_store_memory": STORE_BYTES,
        "node_ip_address": "127.0.0.1",
    }


@contextlib.contextmanager
def local_cluster(nodes: int, *, cpus: int = 1) -> Iterator[Cluster]:
    """``nodes`` Ray nodes on this machine, the driver connected; all stopped through their handles."""
    directory = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths
    saved = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_TMPDIR=directory, RAY_USAGE_STATS_ENABLED="0")
    cluster = Cluster(
        initialize_head=True, head_node_args={**node_args(cpus), "include_dashboard": False}
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node_args(cpus))
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
        shutil.rmtree(directory, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def cluster_nodes(cluster: Cluster) -> list[Any]:
    """The cluster's live nodes (``ray._private.node.Node``), the head's first."""
    nodes: list[Any] = cluster.list_all_nodes()  # type: ignore[no-untyped-call]
    return nodes


def raylet_pid(node: Any) -> int:
    """The process id of a cluster node's raylet (what ``RAY_RAYLET_PID`` says in its workers)."""
    return int(node.all_processes["raylet"][0].process.pid)
