"""Which Triton host a replica gets (serve/engines/triton/select.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from serve.config import ModelConfig, TritonConfig
from serve.engines.triton.replica import TritonReplica
from serve.engines.triton.select import (
    HostUnavailable,
    choose_host,
    decide_mode,
    in_process_unavailable_reason,
)
from serve.engines.triton.sidecar import SidecarHost

HERE = in_process_unavailable_reason()  # None in the NGC image, a reason on Debian 12


@pytest.mark.parametrize(
    ("mode", "reason", "chosen"),
    [
        ("auto", None, "in_process"),
        ("auto", "no module", "sidecar"),
        ("in_process", None, "in_process"),
        ("sidecar", None, "sidecar"),
        ("sidecar", "no module", "sidecar"),
    ],
)
def test_decide_mode(mode, reason, chosen):
    assert decide_mode(mode, reason) == chosen


def test_forcing_in_process_where_it_cannot_load_names_the_reason():
    with pytest.raises(HostUnavailable, match="cannot load here: GLIBCXX_3.4.32 not found"):
        decide_mode("in_process", "GLIBCXX_3.4.32 not found")


def test_the_probe_tells_the_truth_about_this_machine():
    try:
        import tritonserver  # noqa: F401
    except ImportError as exc:
        assert HERE is not None and str(exc) in HERE
    else:
        assert HERE is None


def record(picked: list[str]):
    return {
        mode: (lambda config, startup, m=mode: picked.append(m) or m)
        for mode in ("in_process", "sidecar")
    }


def test_auto_takes_in_process_when_the_probe_says_it_loads():
    picked: list[str] = []
    choose_host(TritonConfig(mode="auto"), probe=lambda: None, hosts=record(picked))
    choose_host(TritonConfig(mode="auto"), probe=lambda: "no module", hosts=record(picked))
    assert picked == ["in_process", "sidecar"]


def test_sidecar_mode_does_not_probe():
    def probe():
        raise AssertionError("sidecar mode must not import tritonserver")

    assert choose_host(TritonConfig(mode="sidecar"), probe=probe, hosts=record([])) == "sidecar"


@pytest.mark.skipif(HERE is None, reason="the in-process API loads here")
def test_on_this_machine_auto_is_a_sidecar_and_in_process_refuses(tmp_path):
    host = choose_host(TritonConfig(mode="auto", model_repository=tmp_path))
    assert isinstance(host, SidecarHost) and host.process.model_repository == tmp_path
    model = ModelConfig(id="m", triton=TritonConfig(mode="in_process", model_repository=tmp_path))
    with pytest.raises(HostUnavailable, match="import tritonserver"):
        asyncio.run(object.__new__(TritonReplica).__init__(model))  # before Triton starts


@pytest.mark.skipif(HERE is not None, reason=f"in-process API unavailable: {HERE}")
def test_where_it_loads_auto_is_in_process(tmp_path):
    from serve.engines.triton.in_process import InProcessHost

    host = choose_host(TritonConfig(mode="auto", model_repository=tmp_path))
    assert isinstance(host, InProcessHost) and host.repository == tmp_path.resolve()


def test_modes_are_validated_by_name():
    with pytest.raises(ValidationError, match="in_process"):
        TritonConfig(mode="in-process")
    assert TritonConfig(mode="in_process").mode == "in_process"


def test_an_injected_host_is_used_as_it_is():
    started = []
    host = SimpleNamespace(
        start=lambda: started.append(True),
        stop=lambda: None,
        metrics=lambda: None,
        exited=lambda: False,
    )
    model = ModelConfig(id="m", triton=TritonConfig(mode="in_process"))

    async def build():
        replica = object.__new__(TritonReplica)
        await replica.__init__(model, host=host)
        return replica

    assert asyncio.run(build()).host is host and started == [True]


def test_triton_loads_the_engine_step_alone_where_the_replica_tokenizes(built_repository):
    def engine_step_alone(**model) -> str | None:
        replica = object.__new__(TritonReplica)
        triton = {"model_repository": built_repository} | model.pop("triton", {})
        replica.model = ModelConfig(id="m", triton=TritonConfig(**triton), **model)
        return replica._engine_step_alone()

    assert engine_step_alone() == "tensorrt_llm"
    # The ensemble's own path, and a model that is no preprocessing-engine-postprocessing
    # chain, need everything; an embeddings model is one model.
    assert engine_step_alone(triton={"pipeline": "ensemble"}) is None
    assert engine_step_alone(triton_model="tensorrt_llm") is None
    assert engine_step_alone(task="embed") is None
