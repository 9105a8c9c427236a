"""make soak's checks on made-up outcomes and readings (the soak itself:
tests/integration/test_soak.py runs a one-minute one)."""

from __future__ import annotations

from tests.soak import soak_config, summary, traffic_checks
from tests.soak_rss import rss_growth
from tests.soak_traffic import CLASSES, Outcome, expected

MIB = 1024


def reading(process: str, mib: float) -> dict:
    return {"process": process, "node": "head", "rss_kib": int(mib * MIB)}


def test_growth_fails_above_10_percent_and_the_floor_and_an_ended_replica_fails():
    warm = {
        1: reading("raylet", 30),
        2: reading("stub tensorrt_llm", 400),
        3: reading("haproxy", 10),
    }
    warm |= {4: reading("ray::ServeReplica:llm:Triton-x", 170), 5: reading("ray::IDLE", 60)}
    end = {
        1: reading("raylet", 33.5),
        2: reading("stub tensorrt_llm", 445),
        3: reading("haproxy", 13),
    }
    rows, (grew, ended) = rss_growth(warm, end)
    over = {row["process"] for row in rows if row["over"]}
    # raylet: +3.5 MiB (12%) is under the floor; haproxy: +3 MiB (30%) too; the stub's
    # +45 MiB (11%) is over both.
    assert over == {"stub tensorrt_llm"} and not grew["ok"]
    assert "stub tensorrt_llm (2): 11.2%" in grew["detail"]
    # An idle Ray worker may end; a replica may not.
    assert not ended["ok"] and ended["detail"] == "ray::ServeReplica:llm:Triton-x (4)"
    assert all(check["ok"] for check in rss_growth(warm, warm)[1])


def answered(kind: str, status: str = "200") -> Outcome:
    return Outcome(kind, status, 0.1)


def every_class_answered() -> list[Outcome]:
    statuses = {"bad-model": "404", "bad-max-tokens": "400", "bad-json": "400"}
    outcomes = [answered(kind, statuses.get(kind, "200")) for kind in CLASSES]
    return outcomes + [answered("burst"), answered("burst", "503")]


def failed(checks: list[dict]) -> set[str]:
    return {check["check"] for check in checks if not check["ok"]}


def test_traffic_passes_only_with_expected_statuses_and_refused_bursts():
    outcomes = every_class_answered()
    assert not failed(traffic_checks(outcomes, hanging=0))
    assert failed(traffic_checks(outcomes, hanging=1)) == {"no client still in a request"}
    for wrong in ("500", "503-without-retry-after", "ReadTimeout", "stream-error", "200"):
        checks = traffic_checks([*outcomes, answered("bad-model", wrong)], hanging=0)
        assert len(failed(checks)) == 1 and "every status expected" in failed(checks).pop()
    no_refusal = [o for o in outcomes if o.status != "503"]
    assert failed(traffic_checks(no_refusal, 0)) == {"bursts refused in part with 503"}
    no_chat = [o for o in outcomes if o.kind != "chat"]
    assert failed(traffic_checks(no_chat, 0)) == {"every class answered"}


def test_a_503_is_expected_of_every_class_and_latency_counts_expected_answers():
    assert expected(answered("chat", "503")) and expected(answered("bad-json", "503"))
    assert not expected(answered("bad-json", "200"))
    outcomes = [Outcome("chat", "200", s / 100) for s in range(1, 101)]
    outcomes.append(Outcome("chat", "ReadTimeout", 60.0))
    figures = summary(outcomes)["chat"]
    assert figures["statuses"] == {"200": 100, "ReadTimeout": 1}
    assert (figures["p50_s"], figures["p99_s"]) == (0.51, 1.0)


def test_the_soak_serves_the_shipped_models_with_a_small_queue_bound(monkeypatch, tmp_path):
    monkeypatch.setattr("tests.soak.build_repository", lambda: tmp_path / "llm")
    monkeypatch.setattr("tests.soak.build_embedding_repository", lambda: tmp_path / "emb")
    llm, embeddings = soak_config()["applications"][0]["args"]["models"]
    assert (llm["id"], embeddings["id"]) == ("tritonllm-default", "all-MiniLM-L6-v2")
    assert llm["triton"]["model_repository"] == str(tmp_path / "llm")
    assert llm["deployment"]["num_replicas"] == 2 and llm["deployment"]["max_queued_requests"] == 4
    assert embeddings["triton"]["model_repository"] == str(tmp_path / "emb")
