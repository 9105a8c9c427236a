"""The soak's memory readings: the resident memory (VmRSS) of every process of a test
cluster, each named by what it is, and the growth between two readings."""

from __future__ import annotations

from pathlib import Path

from tests.integration.cluster import RayCluster

GROWTH_LIMIT = 0.10
# A process may grow by this much whatever its size: RSS moves in steps (a malloc arena,
# a lazily imported module, a thread's stack touched once) of a few MiB that are no
# trend, and in the smallest processes (haproxy, a raylet: 10-40 MiB) one such step is
# already 10%. A leak over a long run grows past it.
GROWTH_FLOOR_KIB = 4 * 1024
# Processes of the app: one ending during the soak is a crash, not churn (Ray starts
# and ends idle workers as it likes).
APP_PROCESSES = ("ray::Serve", "tritonserver", "stub ")


def rss_snapshot(cluster: RayCluster) -> dict[int, dict]:
    """pid to ``{"process", "node", "rss_kib"}`` for every live process of ``cluster``."""
    # A node's temp dir names its processes; the head's few that do not name the GCS
    # port (which a worker node's name too, so it comes last).
    nodes = {str(n.temp_dir): n.name for n in cluster.nodes}
    nodes |= {str(cluster.temp_dir): "head", f":{cluster.gcs_port} ": "head"}
    snapshot = {}
    for pid in cluster.pids():
        rss = rss_kib(pid)
        if rss is not None:
            snapshot[pid] = {"process": label(pid), "node": node_of(pid, nodes), "rss_kib": rss}
    return snapshot


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None  # ended, or a zombie (no VmRSS)


def argv(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def label(pid: int) -> str:
    """What the process is: a Ray worker's title (``ray::ServeReplica:llm:...``), a
    replica's Triton, the model of a Python backend stub, what a Python process runs,
    else its program."""
    args = argv(pid) or ["?"]
    program = Path(args[0].split(" ")[0]).name
    if args[0].startswith(("ray::", "ray-dashboard-")):
        return args[0].split(" (")[0]
    if program == "tritonserver":
        return f"tritonserver of {label(parent(pid)).rsplit(':', 1)[-1]}"
    if program == "triton_python_backend_stub" and len(args) > 1:
        return f"stub {Path(args[1]).parent.parent.name}"  # <repository>/<model>/1/model.py
    if program.startswith("python") and "-c" in args[:-1]:
        return "python -c " + args[args.index("-c") + 1].split(";")[0]
    if program.startswith("python"):
        script = next((a for a in args[1:] if not a.startswith("-")), "")
        return Path(script).name or program
    return program


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def node_of(pid: int, nodes: dict[str, str]) -> str:
    """The node whose temp dir the process, or its nearest ancestor that names one,
    has in its command line (a Ray worker's title hides it; its raylet's shows it)."""
    while pid > 1:
        command = " ".join(argv(pid)) + " "
        for temp_dir, name in nodes.items():
            if temp_dir in command:
                return name
        pid = parent(pid)
    return "?"


def rss_growth(warm: dict[int, dict], end: dict[int, dict]) -> tuple[list[dict], list[dict]]:
    """Each process's RSS after warm-up and at the end (None: it ended), and the
    checks: no process over the limit, no process of the app ended."""
    rows = []
    for pid, before in sorted(warm.items(), key=lambda item: item[1]["process"]):
        after = end.get(pid, {}).get("rss_kib")
        grown = None if after is None else after - before["rss_kib"]
        rows.append(
            {
                "pid": pid,
                "process": before["process"],
                "node": before["node"],
                "warm_kib": before["rss_kib"],
                "end_kib": after,
                "growth_pct": None if grown is None else round(100 * grown / before["rss_kib"], 1),
                "over": grown is not None
                and grown > max(GROWTH_FLOOR_KIB, GROWTH_LIMIT * before["rss_kib"]),
            }
        )
    over = [f"{r['process']} ({r['pid']}): {r['growth_pct']}%" for r in rows if r["over"]]
    ended = [
        f"{r['process']} ({r['pid']})"
        for r in rows
        if r["end_kib"] is None and r["process"].startswith(APP_PROCESSES)
    ]
    limit = f"{GROWTH_LIMIT:.0%} (and {GROWTH_FLOOR_KIB // 1024} MiB)"
    return rows, [
        {"check": f"no process grew over {limit}", "ok": not over, "detail": "; ".join(over)},
        {"check": "no process of the app ended", "ok": not ended, "detail": "; ".join(ended)},
    ]
