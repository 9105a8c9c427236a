"""The app's metrics collector: the latest Prometheus text of each of its processes,
merged into the one exposition ``GET /metrics`` answers (why: :mod:`serve.metrics`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from serve.metrics import PUSH_PERIOD_S

log = logging.getLogger("ray.serve")

# A process that has not pushed for this long has ended (or lost its Triton): its
# series leave the exposition rather than freeze at their last value.
STALE_AFTER_S = 3 * PUSH_PERIOD_S + 2


@dataclass
class _Snapshot:
    labels: dict[str, str]
    text: str
    sequence: int
    received: float


class MetricsCollector:
    """Plain class; :func:`serve.app.build_app` makes it a one-replica deployment.

    ``push`` keeps a process's latest text as it is; ``render`` merges on a scrape
    (scrapes are rarer than pushes).
    """

    def __init__(self, stale_after_s: float = STALE_AFTER_S, clock=time.monotonic):
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._latest: dict[tuple, _Snapshot] = {}

    async def push(self, labels: dict[str, str], text: str, sequence: int) -> None:
        """``text``: the Prometheus text of the process ``labels`` name, its
        ``sequence``-th push (a late one never replaces a newer one)."""
        key = tuple(sorted(labels.items()))
        known = self._latest.get(key)
        if known is None or sequence > known.sequence:
            self._latest[key] = _Snapshot(labels, text, sequence, self._clock())

    async def render(self) -> str:
        now = self._clock()
        self._latest = {
            key: snapshot
            for key, snapshot in self._latest.items()
            if now - snapshot.received <= self._stale_after_s
        }
        return merge((s.labels, s.text) for s in self._latest.values())


@dataclass
class _Family:
    help: str = ""  # the HELP line, as the first process sent it
    kind: str = ""  # the TYPE (empty: untyped)
    samples: list[str] = field(default_factory=list)


# Sample names of a family beside its own name (histograms, summaries, counters).
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def merge(sources) -> str:
    """One Prometheus text (format 0.0.4) of several processes' ``(labels, text)``,
    each sample with its process's ``labels`` added; a family's lines stay together,
    with one HELP and TYPE. Line-based, not through ``prometheus_client``'s parser,
    which renames a counter's samples to ``<name>_total`` (Triton's
    ``nv_inference_request_success`` would change name). ``deployment`` and
    ``replica`` are reserved: no process's own labels use them.
    """
    families: dict[str, _Family] = {}
    for labels, text in sources:
        _add_source(families, labels, text)
    lines = []
    for name, family in families.items():
        if family.samples:
            lines += [family.help] if family.help else []
            lines += [f"# TYPE {name} {family.kind}"] if family.kind else []
            lines += family.samples
    return "\n".join(lines) + "\n" if lines else ""


def _add_source(families: dict[str, _Family], labels: dict[str, str], text: str) -> None:
    """Adds one process's samples to ``families``. A family two processes export with
    different types keeps the first type seen; this process's samples of it are left
    out (and logged)."""
    added = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    current, skipping = "", False
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # a comment
            current = parts[2]
            family = families.setdefault(current, _Family())
            if parts[1] == "HELP":
                family.help = family.help or line
                continue
            kind = parts[3].strip() if len(parts) > 3 else ""
            skipping = bool(family.kind) and kind != family.kind
            if skipping:
                log.warning("%s: %s here, %s elsewhere; left out", current, kind, family.kind)
            family.kind = family.kind or kind
        elif line.strip():
            end = min(i for i in (line.find("{"), line.find(" "), len(line)) if i >= 0)
            name = line[:end]
            if name != current and not any(name == current + s for s in _SUFFIXES):
                current, skipping = name, False  # a sample with no HELP/TYPE of its own
            if not skipping:
                families.setdefault(current, _Family()).samples.append(_add(line, end, added))


def _add(line: str, end: int, labels: str) -> str:
    """The sample ``line`` (its name ends at ``end``) with ``labels`` added."""
    if end < len(line) and line[end] == "{":
        rest = line[end + 1 :]
        return f"{line[: end + 1]}{labels}{'' if rest.lstrip().startswith('}') else ','}{rest}"
    return f"{line[:end]}{{{labels}}}{line[end:]}"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
