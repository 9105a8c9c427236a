"""``make soak`` for 30 s (CI's version; the default run is 10 minutes): mixed traffic
against a two-node cluster, three bursts past the queue bound among it, and every check
of tests/soak.py must pass."""

from __future__ import annotations

import json

import pytest

from tests import soak

pytestmark = pytest.mark.integration


def test_a_short_soak_passes(built_repository, built_embedding_repository, tmp_path):
    out = tmp_path / "results.json"
    exit_code = soak.main(["--minutes", "0.5", "--warmup-s", "20", "--out", str(out)])
    result = json.loads(out.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert exit_code == 0 and not failed, failed
    assert sum(sum(c["statuses"].values()) for c in result["requests"].values()) > 100
