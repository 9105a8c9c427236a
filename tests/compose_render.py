"""docker/compose.yaml as `docker compose config` renders it, for hosts without a compose CLI.

What the tests need of Compose's semantics: YAML merge keys (``<<``), variable
interpolation (``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``,
``${VAR?error}``, ``$$``), profiles (a service with profiles runs only when one is
active), and relative bind-mount sources resolved against the compose file's folder.
Where a compose CLI exists, tests/unit/serve/test_docker.py also runs the real one.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

_VARIABLE = re.compile(
    r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(ValueError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        value = env.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset else value
        if op in (":?", "?"):
            if unset:
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return value
        return value or ""

    return _VARIABLE.sub(replace, text)


def _interpolate_tree(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(n, env) for n in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


def render(path: Path, env: dict[str, str], profiles: tuple[str, ...] = ()) -> dict:
    """The services that ``docker compose --profile ... config`` would list."""
    document = yaml.safe_load(path.read_text())  # merge keys (<<) resolve here
    document = {k: v for k, v in document.items() if not k.startswith("x-")}
    document = _interpolate_tree(document, env)
    services = {}
    for name, service in document["services"].items():
        if service.get("profiles") and not set(service["profiles"]) & set(profiles):
            continue
        service = dict(service)
        service["volumes"] = [_resolve_volume(v, path.parent) for v in service.get("volumes", [])]
        services[name] = service
    return {**document, "services": services}


def _resolve_volume(volume: str, base: Path) -> dict:
    source, target, *mode = volume.split(":")
    if source.startswith((".", "/", "~")):
        source = str((base / source).resolve()) if source.startswith(".") else source
        kind = "bind"
    else:
        kind = "volume"
    return {"type": kind, "source": source, "target": target, "read_only": mode == ["ro"]}
