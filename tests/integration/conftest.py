"""Fixtures of the integration tests that start a Ray cluster (one per test session)."""

from __future__ import annotations

import pytest

from tests.integration.cluster import RayCluster


@pytest.fixture(scope="session")
def cluster():
    """``ray start --head`` with 4 logical CPUs (room for two Triton replicas beside
    the ingress); each test ``serve deploy``s its own config of the app ``llm``."""
    cluster = RayCluster(num_cpus=4).start()
    yield cluster
    cluster.stop()
