"""make bench-fairness's own parts: the stack's config, the tenants' requests, the checks."""

from __future__ import annotations

import math

import yaml
from rich.console import Console

from bench import fairness
from serve.api.common.keyring import load_tenants
from serve.app import fair_seats
from serve.config import AppConfig
from tests.conftest import REPOSITORY


def test_the_stack_has_the_tenants_and_its_target_as_seats(tmp_path):
    assert fairness.parse_args(["--max-batch-size", "12"]).target == 12  # as the app's
    args = fairness.parse_args(["--target", "6", "--max-batch-size", "12"])
    assert (args.flood_clients, args.priority_clients) == (30, 30)  # 10x a share of 3
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump(fairness.TENANTS))
    for fair in (True, False):
        config = fairness.bench_config(args, REPOSITORY, 8123, tenants, fair)
        app = AppConfig.model_validate(config["applications"][0]["args"])
        (model,) = app.models
        assert fair_seats(app) == ({model.id: 6} if fair else {})
        assert model.deployment.max_ongoing_requests == 24  # the batch's room, twice
        assert app.api_keys.tenants_file == tenants
    assert [t.name for t in load_tenants(tenants, [model.id])] == [
        "interactive",
        "batch",
        "mixed",
    ]


def test_a_tenants_requests_carry_its_key_and_priority():
    target = fairness.TenantTarget("http://127.0.0.1:1", "bench-mixed", 4, priority=5)
    assert target.body("p", 8) | {"prompt": "p"} == target.body("p", 8)
    assert target.body("p", 8)["priority"] == 5 and target._headers == {
        "Authorization": "Bearer bench-mixed"
    }
    assert "priority" not in fairness.TenantTarget("http://x", "k", 1).body("p", 8)


def _round(fair: bool, beside_ms: float, high_ms: float, refused: int = 0) -> dict:
    tenant = {"ttft_p50_ms": 40.0, "tokens_per_s": 30.0, "refused": 0, "errors": 0}
    flood = {"interactive": tenant | {"ttft_p50_ms": beside_ms, "refused": refused}}
    flood["batch"] = tenant | {"tokens_per_s": 400.0}
    return {
        "round": 1,
        "fair_shares": fair,
        "alone": {"interactive": tenant},
        "flood": flood,
        "priority": {
            "high": tenant | {"ttft_p50_ms": high_ms},
            "low": tenant | {"ttft_p50_ms": 1000.0},
        },
        "interactive_ttft_ratio": beside_ms / 40.0,
        "priority_ttft_ratio": high_ms / 1000.0,
    }


def test_the_checks_hold_the_rounds_with_fair_shares_to_the_issues_targets():
    passing = fairness.checks([_round(True, 50.0, 200.0), _round(False, 4000.0, 900.0)])
    assert len(passing) == 3 and all(c["pass"] for c in passing)  # off is not checked
    missing = fairness.checks([_round(True, 70.0, 400.0, refused=1)])
    assert [c["pass"] for c in missing] == [False, False, False]
    assert math.isclose(missing[0]["value"], 1.75)
    console = Console(record=True, width=200)
    console.print(fairness.table([_round(True, 50.0, 200.0)], "t"))
    assert "1.25" in console.export_text()
