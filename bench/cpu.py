"""CPU seconds by process role over a benchmark level: where the time goes.

On a CPU box the engine and the front door share the same cores, so every CPU second
the front door spends per token is taken from decoding. Each level reads every
process's user + system time from ``/proc`` before and after (Linux only; elsewhere
the figures are simply absent) and sums the difference by role: the engine (the
``tensorrt_llm`` model's Python stub), pre/postprocessing stubs, Triton's core, Serve's
HTTP proxy (or HAProxy), the ingress replica, the Triton replica, the pipeline
baseline, the vLLM replicas (Ray Serve LLM's ``LLMServer``, or the stack's subclass of
it) and vLLM's engine core, and the rest of Ray. Processes below the Triton that runs
alone, (b), are kept apart under a ``triton:`` prefix, those of Ray Serve LLM's own Ray
instance, (d), under ``rayllm:``, and those of the stack over vLLM, (e), under
``stack-vllm:``, so each system's figures are its own.

psutil would give the same numbers; it is not a dependency of this project, and the
two ``/proc`` fields it would read are all this needs.
"""

from __future__ import annotations

import os
from pathlib import Path

# (substring of the command line, role); the first match wins.
ROLES = (
    # The stub's command line names its model's file; Triton's own may name the model
    # too (--load-model=tensorrt_llm, where a replica loads the engine step alone).
    ("tensorrt_llm/1/model.py", "engine"),
    ("triton_python_backend_stub", "pre/postprocessing"),
    ("tritonserver", "triton core"),
    ("ray::ProxyActor", "serve proxy"),
    ("haproxy", "serve proxy"),
    ("OpenAIIngress", "ingress replica"),
    ("ServeReplica:llm:Triton-", "triton replica"),
    ("PipelineBaseline", "pipeline replica"),
    # Ray Serve LLM (build_openai_app): vLLM titles its engine process VLLM::EngineCore
    # (the scheduler) and, on CPU, that process's child VLLM::Worker (the model forward);
    # Ray Serve LLM's ingress is OpenAiIngress, and its LLMServer replica (the only other
    # replica of its app) runs vLLM's AsyncLLM front end: tokenization, detokenization,
    # the OpenAI response objects.
    ("VLLM::EngineCore", "vllm engine core"),
    ("VLLM::Worker", "vllm worker"),
    ("ServeReplica:rayllm:OpenAiIngress", "ingress replica"),
    ("ServeReplica:rayllm:", "llm server replica"),
    ("ServeReplica:llm:vLLM-", "llm server replica"),  # the stack's, serve.config's name
    ("ray", "ray (other)"),
)
FRONT_DOOR = ("serve proxy", "ingress replica", "triton replica")
# Over vLLM, Ray Serve LLM's or the stack's: the LLMServer replica holds vLLM's
# AsyncLLM (tokenizer, detokenizer, its output objects), so this front door does more.
VLLM_FRONT_DOOR = ("serve proxy", "ingress replica", "llm server replica")
# Every process a streamed token crosses, from the engine to the client's socket.
SERVING_PATH = ("engine", "pre/postprocessing", "triton core", *FRONT_DOOR)
LOAD_GENERATOR = "load generator"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(pid: str) -> tuple[int, float, str, int] | None:
    """(parent pid, CPU seconds, command line, start time in ticks) of one process;
    None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    cpu_s = (int(fields[11]) + int(fields[12])) / _TICKS
    return int(fields[1]), cpu_s, cmdline, int(fields[19])


def snapshot() -> dict[int, tuple[int, float, str, int]]:
    """Every process now: pid -> (parent pid, CPU seconds, command line, start time)."""
    if not Path("/proc/self/stat").exists():
        return {}
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _read(entry)) is not None:
            found[int(entry)] = info
    return found


def _role(cmdline: str) -> str | None:
    return next((role for key, role in ROLES if key in cmdline), None)


def _descendants(processes: dict, root: int | None) -> set[int]:
    found = {root} if root in processes else set()
    grew = True
    while grew:
        new = {pid for pid, (ppid, *_) in processes.items() if ppid in found} - found
        found |= new
        grew = bool(new)
    return found


def by_role(
    before: dict,
    after: dict,
    triton_alone_pid: int | None = None,
    client_pid: int | None = None,
    apart: dict[str, int | None] | None = None,
) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots (processes born in between
    count from zero); Triton-alone's processes under ``triton:``, those below each pid
    of ``apart`` under its name (``{"rayllm": pid}``: ``rayllm:``), the benchmark's own
    process (``client_pid``) as the load generator."""
    owner = {}
    for prefix, root in {"triton": triton_alone_pid, **(apart or {})}.items():
        owner |= dict.fromkeys(_descendants(after, root), prefix)
    spent: dict[str, float] = {}
    for pid, (_, cpu, cmdline, started) in after.items():
        role = LOAD_GENERATOR if pid == client_pid else _role(cmdline)
        if role is None:
            continue
        if pid in owner:
            role = f"{owner[pid]}:{role}"
        # Same pid and start time: the same process (Ray retitles its workers per call,
        # so the command line may differ).
        earlier = before.get(pid)
        delta = cpu - (earlier[1] if earlier and earlier[3] == started else 0.0)
        if delta > 0:
            spent[role] = round(spent.get(role, 0.0) + delta, 2)
    return dict(sorted(spent.items()))


def ms_per_token(spent: dict[str, float], tokens: int, roles) -> float | None:
    """CPU milliseconds per output token summed over ``roles`` (None: no tokens)."""
    if not tokens:
        return None
    return 1000 * sum(spent.get(role, 0.0) for role in roles) / tokens


def front_door_ms_per_token(
    spent: dict[str, float], tokens: int, roles=FRONT_DOOR, prefix: str = ""
) -> float | None:
    """A front door's CPU per output token: by default the stack's outside Triton
    (proxy, ingress, Triton replica); ``VLLM_FRONT_DOOR`` with ``prefix="rayllm:"``
    for Ray Serve LLM's."""
    keys = [prefix + role for role in roles]
    if not tokens or not any(key in spent for key in keys):
        return None
    return 1000 * sum(spent.get(key, 0.0) for key in keys) / tokens


def own_ms_per_token(spent: dict[str, float], tokens: int, prefix: str = "") -> dict[str, float]:
    """CPU ms per output token of each role under ``prefix`` alone (``""``: the roles
    kept apart under no prefix), the load generator left out; {} without tokens."""
    if not tokens:
        return {}
    return {
        role[len(prefix) :]: round(1000 * seconds / tokens, 3)
        for role, seconds in spent.items()
        if role.startswith(prefix) and ":" not in role[len(prefix) :] and role != LOAD_GENERATOR
    }
