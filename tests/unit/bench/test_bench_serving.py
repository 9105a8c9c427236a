"""The serving benchmark's own logic: figures, refusals, ratios, targets, its Serve config.

The benchmark itself is a tool, not a test (tests/integration/test_bench_serving.py runs
a tiny smoke of it end to end).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from bench import cpu, report
from bench.loadgen import RequestRecord, _read_events, _refused, summarize
from bench.serving import level_plan, serve_config
from serve.config import AppConfig


def record(sent, arrivals, end, tokens=3, **kw) -> RequestRecord:
    return RequestRecord(sent=sent, arrivals=arrivals, end=end, tokens=tokens, **kw)


def test_summarize_measures_ttft_itl_and_e2e_of_completed_requests_only():
    records = [
        record(0.0, [0.1, 0.2, 0.4], 0.5),
        record(1.0, [1.3, 1.4, 1.5], 1.6),
        record(2.0, [], 2.0, tokens=0, rejected=True),
        record(3.0, [3.2], 3.3, tokens=1, error="1 tokens instead of 3"),
    ]
    figures = summarize(records, seconds=2.0)
    assert figures["requests"] == 4 and figures["completed"] == 2
    assert figures["errors"] == 1 and figures["rejected_503"] == 1
    assert figures["output_tokens_per_s"] == 3.0  # 6 tokens of completed requests / 2 s
    assert figures["requests_per_s"] == 1.0
    assert figures["ttft_p50_ms"] == pytest.approx(100)  # nearest rank of [100, 300]
    assert figures["ttft_p99_ms"] == pytest.approx(300)
    assert sorted(round(x) for x in (figures["itl_p50_ms"], figures["itl_p99_ms"])) == [100, 200]
    assert figures["e2e_p99_ms"] == pytest.approx(600)
    assert figures["first_errors"] == ["1 tokens instead of 3"]


def test_a_503_is_a_rejection_only_with_retry_after():
    polite, rude, broken = (RequestRecord(sent=0.0) for _ in range(3))
    _refused(polite, 503, {"retry-after": "1"}, "busy")
    _refused(rude, 503, {}, "busy")
    _refused(broken, 500, {}, "boom")
    assert polite.rejected and polite.error is None
    assert not rude.rejected and "without Retry-After" in rude.error
    assert broken.error.startswith("HTTP 500")


class FakeResponse:
    """An aiohttp response whose body comes as given pieces (``pieces``), or as
    ``lines`` ended by \n, each in UTF-8."""

    def __init__(self, lines=(), pieces=None):
        pieces = pieces if pieces is not None else [line + "\n" for line in lines]
        self.content = self  # the body's stream (aiohttp's StreamReader)
        self._pieces = [p if isinstance(p, bytes) else p.encode() for p in pieces]

    async def iter_any(self):
        for piece in self._pieces:
            yield piece


def read(lines) -> RequestRecord:
    r = RequestRecord(sent=0.0)
    asyncio.run(_read_events(FakeResponse(lines), r))
    return r


def test_server_sent_events_count_text_chunks_and_usage():
    r = read(
        [
            'data: {"choices": [{"index": 0, "text": "a"}]}',
            "",
            'data: {"choices": [{"index": 0, "text": ""}]}',  # no text: not a token arrival
            'data: {"choices": [{"index": 0, "text": "b"}]}',
            'data: {"choices": [], "usage": {"completion_tokens": 3}}',
            "data: [DONE]",
        ]
    )
    assert len(r.arrivals) == 2 and r.tokens == 3 and r.error is None


def test_events_are_split_where_sse_ends_lines_only():
    # A model's text may hold U+2028 raw (Ray Serve LLM's JSON does): str.splitlines,
    # which httpx's aiter_lines follows, would cut the event there.
    # A piece may also end inside a character's UTF-8 bytes ("é" is c3 a9).
    pieces = [
        'data: {"choices": [{"index": 0, "text": "a\u2028'.encode() + b"\xc3",
        b'\xa9b"}]}\r\n\r\ndata: [DO',
        b"NE]\n",
    ]
    r = RequestRecord(sent=0.0)
    asyncio.run(_read_events(FakeResponse(pieces=pieces), r))
    assert r.error is None and r.text == "a\u2028\u00e9b" and len(r.arrivals) == 1


def test_an_error_event_or_a_cut_stream_is_an_error():
    assert "boom" in read(['data: {"error": {"message": "boom"}}', "data: [DONE]"]).error
    assert "without [DONE]" in read(['data: {"choices": [{"text": "a"}]}']).error


def test_level_plan_gives_each_client_its_requests_with_a_floor():
    assert level_plan([1, 4, 16], per_client=2, minimum=8) == [(1, 8), (4, 8), (16, 32)]


def level(system, c, tokens_per_s, ttft, errors=0):
    return {
        "system": system,
        "concurrency": c,
        "output_tokens_per_s": tokens_per_s,
        "ttft_p50_ms": ttft,
        "errors": errors,
    }


def test_targets_read_the_ratios_at_each_concurrency():
    results = [
        level("triton", 1, 40, 100),
        level("stack", 1, 40, 104),
        level("pipeline", 16, 50, 9000),
        level("triton", 16, 300, 400),
        level("stack", 16, 290, 410),
        level("triton", 64, 300, 900),
        level("stack", 64, 280, 990, errors=1),
    ]
    rows = {r["concurrency"]: r for r in report.ratios(results)}
    assert rows[16]["stack_over_pipeline"] == pytest.approx(5.8)
    assert rows[16]["stack_over_triton"] == pytest.approx(290 / 300)
    assert rows[64]["ttft_p50_added_ms"] == pytest.approx(90)
    verdicts = {t["name"]: t["pass"] for t in report.check_targets(results)}
    assert verdicts == {
        "front door cost, tokens/s at c=1": True,  # 0%
        "front door TTFT p50 added at c=1": False,  # +4 ms
        "(c)/(a) tokens/s at c=16": True,
        "front door cost, tokens/s at c=16": True,  # 3.3%
        "front door cost, tokens/s at c=64": False,  # 6.7%
        "(c) errors up to c=64": False,
    }


def test_the_serve_config_runs_the_stack_on_one_replica_beside_the_baseline(tmp_path):
    config = serve_config(tmp_path / "repo", 8123, baseline_threads=2)
    assert config["http_options"]["port"] == 8123
    stack, baseline = config["applications"]
    args = AppConfig.model_validate(stack["args"])  # still a valid app config
    assert [m.task for m in args.models] == ["generate"]  # no embeddings replica beside it
    deployment = args.models[0].deployment
    assert deployment.num_replicas == 1 and deployment.autoscaling_config is None
    assert args.models[0].triton.model_repository == tmp_path / "repo"
    assert baseline["route_prefix"] == "/baseline"
    assert baseline["args"]["checkpoint"].endswith("tensorrt_llm/1/hf_model")


def test_throughput_mode_turns_on_rays_high_throughput_serving_in_a_private_dir():
    from bench.serving import serve_mode_env

    with serve_mode_env("default") as env:
        assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in env and "RAY_ADDRESS" not in env
    with serve_mode_env("throughput") as env:
        assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        socket = env["RAY_SERVE_HAPROXY_SOCKET_PATH"]
        # HAProxy refuses an admin socket path over 97 bytes (Ray adds a 57-byte folder).
        assert len(socket) + 57 <= 97 and not socket.startswith("/tmp/haproxy-serve")
        folder = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
        assert os.path.isdir(folder)
    assert not os.path.isdir(folder)


def test_cpu_by_role_keeps_triton_alone_apart_and_counts_new_processes_from_zero():

    engine = "triton_python_backend_stub /r/tensorrt_llm/1/model.py"
    post = "triton_python_backend_stub /r/postprocessing/1/model.py"
    ingress = "ray::ServeReplica:llm:OpenAIIngress"
    # pid: (parent pid, CPU seconds, command line, start time)
    before = {
        10: (1, 5.0, "tritonserver --model-repository=/r", 7),  # (b), Triton alone
        11: (10, 40.0, engine, 7),
        20: (1, 3.0, "ray::ServeReplica:llm:Triton-tritonllm-default", 7),
        # The stack's own Triton, which loads the engine step alone.
        21: (20, 2.0, "tritonserver --model-repository=/r --load-model=tensorrt_llm", 7),
        22: (21, 30.0, engine, 7),
        30: (1, 7.0, "ray::ProxyActor", 7),
        31: (1, 1.0, ingress, 7),
        32: (1, 99.0, "ray::IDLE", 7),
        40: (1, 1.0, "python -m bench.serving", 7),  # no role: not counted
    }
    after = before | {
        11: (10, 52.5, engine, 7),
        20: (1, 4.0, "ray::ServeReplica:llm:Triton-tritonllm-default", 7),
        22: (21, 41.0, engine, 7),
        23: (21, 0.5, post, 9),  # born during the level
        30: (1, 9.0, "ray::ProxyActor", 7),
        31: (1, 2.5, f"{ingress}.handle_request_streaming", 7),  # Ray retitled it
        32: (1, 0.25, "ray::IDLE", 9),  # the pid of a process that ended, reused
        40: (1, 3.0, "python -m bench.serving", 7),
    }
    spent = cpu.by_role(before, after, triton_alone_pid=10)
    assert spent == {
        "engine": 11.0,
        "ingress replica": 1.5,
        "pre/postprocessing": 0.5,
        "ray (other)": 0.25,
        "serve proxy": 2.0,
        "triton replica": 1.0,
        "triton:engine": 12.5,
    }
    # proxy 2.0 + ingress 1.5 + Triton replica 1.0 over 1,500 tokens
    assert cpu.front_door_ms_per_token(spent, 1500) == pytest.approx(3.0)
    assert cpu.front_door_ms_per_token({"engine": 3.0}, 1500) is None


def test_cpu_snapshot_reads_this_process():

    first = cpu.snapshot()[os.getpid()]
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn a little CPU
        pass
    second = cpu.snapshot()[os.getpid()]
    assert first[0] == os.getppid() and "pytest" in first[2] and first[3] == second[3]
    assert second[1] - first[1] >= 0.2


def test_rayllm_is_ray_serve_llms_own_app_with_the_shipped_cpu_settings(tmp_path):
    from bench.serving import RAYLLM_APP, RAYLLM_MODEL, rayllm_config

    config = rayllm_config(tmp_path / "hf_model", 8124)
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8124}
    (app,) = config["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    assert app["name"] == RAYLLM_APP == "rayllm"  # bench/cpu.py's roles key on it
    (llm,) = app["args"]["llm_configs"]
    assert llm["model_loading_config"] == {
        "model_id": RAYLLM_MODEL,
        "model_source": str(tmp_path / "hf_model"),
    }
    assert llm["accelerator_config"] == {"kind": "cpu"}
    assert llm["engine_kwargs"]["dtype"] == "float32"
    assert llm["engine_kwargs"]["max_model_len"] >= 512
    assert llm["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"]
    deployment = llm["deployment_config"]
    assert deployment["num_replicas"] == 1 and deployment["ray_actor_options"]["num_cpus"] == 0
    assert app["args"]["ingress_deployment_config"]["ray_actor_options"]["num_cpus"] == 0
    # GPU boxes: no CPU accelerator, vLLM's own dtype; the shipped config left as it is.
    gpu = rayllm_config(tmp_path, 8125, gpus_per_replica=1)["applications"][0]
    (gpu_llm,) = gpu["args"]["llm_configs"]
    assert "accelerator_config" not in gpu_llm and "dtype" not in gpu_llm["engine_kwargs"]
    assert (
        rayllm_config(tmp_path, 8126)["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"][
            "dtype"
        ]
        == "float32"
    )


def test_cpu_by_role_keeps_ray_serve_llms_instance_apart_by_role():

    # pid: (parent pid, CPU seconds, command line, start time); 50: rayllm's serve run
    before = {
        30: (1, 7.0, "ray::ProxyActor", 7),  # the stack's proxy
        50: (1, 1.0, "/v/bin/python /v/bin/serve run --address local rayllm.yaml", 7),
        51: (50, 2.0, "/v/lib/ray/core/src/ray/raylet/raylet --node-id=x", 7),
        52: (51, 3.0, "ray::ProxyActor", 7),
        53: (51, 1.0, "ray::ServeReplica:rayllm:OpenAiIngress", 7),
        54: (51, 4.0, "ray::ServeReplica:rayllm:LLMServer:rayllm-default", 7),
        55: (54, 50.0, "VLLM::EngineCore", 7),
        56: (55, 9.0, "VLLM::Worker", 7),  # vLLM on CPU: the model's forward
    }
    after = before | {
        30: (1, 8.0, "ray::ProxyActor", 7),
        52: (51, 4.5, "ray::ProxyActor", 7),
        53: (51, 3.0, "ray::ServeReplica:rayllm:OpenAiIngress.completions", 7),
        54: (51, 7.0, "ray::ServeReplica:rayllm:LLMServer:rayllm-default.completions", 7),
        55: (54, 62.0, "VLLM::EngineCore", 7),
        56: (55, 29.0, "VLLM::Worker", 7),
    }
    spent = cpu.by_role(before, after, apart={"rayllm": 50})
    assert spent == {
        "rayllm:ingress replica": 2.0,
        "rayllm:llm server replica": 3.0,
        "rayllm:serve proxy": 1.5,
        "rayllm:vllm engine core": 12.0,
        "rayllm:vllm worker": 20.0,
        "serve proxy": 1.0,
    }
    # proxy 1.5 + ingress 2.0 + LLMServer 3.0 over 1,000 tokens; the stack's apart
    assert cpu.front_door_ms_per_token(
        spent, 1000, cpu.VLLM_FRONT_DOOR, "rayllm:"
    ) == pytest.approx(6.5)
    assert cpu.front_door_ms_per_token(spent, 1000) == pytest.approx(1.0)
    assert cpu.own_ms_per_token(spent, 1000, "rayllm:") == {
        "ingress replica": 2.0,
        "llm server replica": 3.0,
        "serve proxy": 1.5,
        "vllm engine core": 12.0,
        "vllm worker": 20.0,
    }
    assert cpu.own_ms_per_token(spent, 1000) == {"serve proxy": 1.0}


def test_ratios_put_the_stack_against_ray_serve_llm_too():
    results = [
        level("triton", 16, 300, 400),
        level("stack", 16, 240, 410),
        level("rayllm", 16, 200, 500),
        level("stack", 64, 250, 900),  # no rayllm level here: no ratio against it
        level("triton", 64, 300, 800),
    ]
    rows = {r["concurrency"]: r for r in report.ratios(results)}
    assert rows[16]["stack_over_rayllm"] == pytest.approx(1.2)
    assert rows[16]["ttft_p50_vs_rayllm_ms"] == pytest.approx(-90)
    assert rows[16]["stack_over_triton"] == pytest.approx(0.8)
    assert "stack_over_rayllm" not in rows[64] and rows[64]["stack_over_triton"] == 250 / 300
    assert "rayllm" in report.SYSTEMS


def test_the_cpu_table_shows_each_systems_own_roles_side_by_side():
    results = [
        {"system": "rayllm", "concurrency": 1, "cpu_ms_per_token": {"vllm engine core": 9.0}},
        {"system": "stack", "concurrency": 1, "cpu_ms_per_token": {"engine": 8.0, "x": 1.5}},
    ]
    lines = report.cpu_markdown(results).splitlines()
    assert lines[0] == "| CPU ms/token | stack c=1 | rayllm c=1 |"
    assert "| engine | 8.00 |  |" in lines and "| vllm engine core |  | 9.00 |" in lines
    assert lines[-1] == "| **total** | **9.50** | **9.00** |"


def test_ratios_put_the_stack_over_vllm_against_ray_serve_llm_alone():
    results = [
        level("rayllm", 1, 30, 120),
        level("stack-vllm", 1, 31, 110),
        level("rayllm", 64, 200, 5000),
        level("stack-vllm", 64, 210, 4000),
    ]
    rows = {r["concurrency"]: r for r in report.ratios(results)}
    assert rows[64]["stack_vllm_over_rayllm"] == pytest.approx(1.05)
    assert rows[1]["ttft_p50_stack_vllm_vs_rayllm_ms"] == pytest.approx(-10)
    assert "stack_over_rayllm" not in rows[64]  # no (c) level: nothing of (c)'s
    verdicts = {t["name"]: t["pass"] for t in report.check_targets(results)}
    assert verdicts == {
        "(e) TTFT p50 less (d)'s at c=1": True,
        "(e)/(d) tokens/s at c=64": False,  # 1.05x, under 1.1x
        "(e) errors up to c=64": True,
    }


def test_the_stack_over_vllm_serves_ray_serve_llms_own_llm_config(tmp_path):
    from bench.serving import rayllm_config, stack_vllm_config

    python = tmp_path / "venv" / "bin" / "python"
    config = stack_vllm_config(tmp_path / "hf_model", 8127, python)
    assert config["http_options"]["port"] == 8127
    args = AppConfig.model_validate(config["applications"][0]["args"])  # a valid app config
    (model,) = args.models
    assert model.engine == "vllm" and model.id == "vllm-default"
    assert model.vllm.python_path() == python
    rayllm = rayllm_config(tmp_path / "hf_model", 8128)["applications"][0]["args"]
    (theirs,) = rayllm["llm_configs"]
    assert theirs["model_loading_config"]["model_source"] == str(model.vllm.checkpoint)
    # The same engine and Serve limits: only the serving layer differs.
    ours = config["applications"][0]["args"]["models"][0]
    assert ours["vllm"]["llm_config"] == {
        k: v for k, v in theirs.items() if k not in ("model_loading_config", "deployment_config")
    }
    assert ours["deployment"] == theirs["deployment_config"]


def test_the_stack_over_vllm_is_counted_apart_with_its_llm_server_in_its_front_door():
    before = {}
    after = {
        60: (1, 1.0, "/v/bin/python /v/bin/serve run --address local stack-vllm.yaml", 7),
        61: (60, 1.0, "ray::ServeReplica:llm:OpenAIIngress", 7),
        62: (60, 2.0, "ray::ServeReplica:llm:vLLM-vllm-default", 7),
        63: (62, 9.0, "VLLM::EngineCore", 7),
        64: (1, 4.0, "ray::ServeReplica:llm:Triton-tritonllm-default", 7),  # (c)'s
    }
    spent = cpu.by_role(before, after, apart={"stack-vllm": 60})
    assert spent["stack-vllm:llm server replica"] == 2.0
    assert spent["stack-vllm:vllm engine core"] == 9.0
    assert spent["triton replica"] == 4.0
    front_door = cpu.front_door_ms_per_token(spent, 1000, cpu.VLLM_FRONT_DOOR, "stack-vllm:")
    assert front_door == pytest.approx(3.0)  # its ingress and LLMServer replica
