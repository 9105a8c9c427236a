"""Fixtures of the integration tests that start a Ray cluster (one per test session),
and what a failed test that used it prints: its Tritons' state and logs."""

from __future__ import annotations

import pytest

from tests.integration.cluster import RayCluster, serve_config

_STARTED = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def cluster():
    """``ray start --head`` with 4 logical CPUs (room for two Triton replicas beside
    the ingress); each test ``serve deploy``s its own config of the app ``llm``."""
    cluster = RayCluster(num_cpus=4).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def one_replica_app(cluster, built_repository) -> str:
    """The shipped config's default model with one replica, on the session's cluster:
    its URL. The modules that ask for it run one after the other (below), and a
    ``serve deploy`` of the config already running restarts nothing (about 2 s where
    a new app takes about 25)."""
    one = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}}
    cluster.deploy(serve_config(built_repository, deployment=one))
    cluster.wait_running()
    return cluster.url


def pytest_collection_modifyitems(config, items):
    """The modules on the session's cluster run last, those on ``one_replica_app``
    first among them: the cluster starts with the first of them, and idles through no
    other module's own stacks (an idle cluster and its app take about a fifth of a core
    here). A module moves whole, so its module-scoped fixtures are set up once. With
    ``--integration-part``, only the modules of that part are kept (a module that uses
    the session's cluster in any test belongs to it)."""
    order: dict = {}
    for item in items:
        if "one_replica_app" in item.fixturenames:
            order[item.module] = 1
        elif "cluster" in item.fixturenames:
            order.setdefault(item.module, 2)
    items.sort(key=lambda item: order.get(item.module, 0))
    part = config.getoption("--integration-part")
    if part is None:
        return
    on_cluster = part == "session-cluster"
    left = [item for item in items if (item.module in order) != on_cluster]
    config.hook.pytest_deselected(items=left)
    items[:] = [item for item in items if (item.module in order) == on_cluster]


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
