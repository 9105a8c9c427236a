"""Fixtures of the integration tests that start a Ray cluster (one per test session),
and what a failed test that used it prints: its Tritons' state and logs."""

from __future__ import annotations

import pytest

from tests.integration.cluster import RayCluster

_STARTED = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def cluster():
    """``ray start --head`` with 4 logical CPUs (room for two Triton replicas beside
    the ingress); each test ``serve deploy``s its own config of the app ``llm``."""
    cluster = RayCluster(num_cpus=4).start()
    yield cluster
    cluster.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the cluster shows its Tritons' logs written meanwhile (a
    replica's Triton and its Python-backend stubs log nowhere else), and their stubs
    that died: a wedged or dead engine is diagnosed from the run's own output."""
    report = (yield).get_result()
    if call.when == "setup":
        item.stash[_STARTED] = call.start
    cluster = getattr(item, "funcargs", {}).get("cluster")
    if report.failed and isinstance(cluster, RayCluster):
        since = item.stash.get(_STARTED, call.start)
        report.sections.append(("Triton (the cluster's)", cluster.triton_report(since)))
