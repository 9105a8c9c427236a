"""Which Triton host a replica runs: in-process where the official API loads, else sidecar.

``triton.mode``: ``auto`` picks in-process when ``import tritonserver`` works (the
import loads the C binding and with it ``libtritonserver.so``), sidecar otherwise;
``in_process`` and ``sidecar`` force one, and a forced in-process host that cannot
load is an error naming the reason, never a silent fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from serve.config import TritonConfig
from serve.engines.triton.host import TritonHost

log = logging.getLogger(__name__)


class HostUnavailable(RuntimeError):
    pass


def in_process_unavailable_reason() -> str | None:
    """None when the in-process API loads here, else what went wrong."""
    try:
        import tritonserver  # noqa: F401
    except (ImportError, OSError) as exc:  # no wheel, wrong Python, old libstdc++, ...
        return f"`import tritonserver` failed: {exc}"
    return None


def decide_mode(mode: str, in_process_reason: str | None) -> str:
    """``in_process`` or ``sidecar`` for a configured ``mode``."""
    if mode == "sidecar":
        return "sidecar"
    if in_process_reason is None:
        return "in_process"
    if mode == "in_process":
        raise HostUnavailable(
            f"triton.mode is in_process but the in-process API cannot load here: "
            f"{in_process_reason}. Use triton.mode auto or sidecar, or run in the GPU "
            "image (docker/Dockerfile.gpu), whose Python has the tritonserver package"
        )
    return "sidecar"


def _sidecar(config: TritonConfig, startup_models: tuple[str, ...]) -> TritonHost:
    from serve.engines.triton.sidecar import SidecarHost

    return SidecarHost(config.repository_path(), config.start_timeout_s, startup_models)


def _in_process(config: TritonConfig, startup_models: tuple[str, ...]) -> TritonHost:
    from serve.engines.triton.in_process import InProcessHost

    return InProcessHost(
        config.repository_path(), config.start_timeout_s, startup_models=startup_models
    )


HostFactory = Callable[[TritonConfig, tuple[str, ...]], TritonHost]
HOSTS: dict[str, HostFactory] = {
    "in_process": _in_process,
    "sidecar": _sidecar,
}


def choose_host(
    config: TritonConfig,
    startup_models: tuple[str, ...] = ("*",),
    probe: Callable[[], str | None] = in_process_unavailable_reason,
    hosts: dict[str, HostFactory] = HOSTS,
) -> TritonHost:
    """The replica's Triton host, not yet started; it loads ``startup_models`` ("*":
    the whole repository) at start."""
    reason = None if config.mode == "sidecar" else probe()
    mode = decide_mode(config.mode, reason)
    why = f" (in-process unavailable: {reason})" if reason and mode == "sidecar" else ""
    log.info("Triton host: %s (triton.mode %s)%s", mode, config.mode, why)
    return hosts[mode](config, startup_models)
