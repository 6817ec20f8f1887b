"""The Ray stage's cluster: started once for the session (a head and two worker nodes of one CPU, on 127.0.0.1),
stopped at the end whatever happened; the tests are skipped where Ray is not installed."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    if not os.environ.get("KVDBG_REQUIRE_RAY"):
        pytest.importorskip("ray")
    from tests.fleet_ray.cluster import LocalCluster

    cluster = LocalCluster(workers=2, cpus=1).start()
    try:
        with cluster.drivers():  # the cluster's token for the drivers (this process's and the kvdbg it starts)
            yield cluster
    finally:
        strays = cluster.stop()
        assert not strays, f"processes of the cluster left after its nodes stopped: {strays}"
