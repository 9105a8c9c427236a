"""Who a request's API key is: the keyring of an app's keys and the tenants they name.

Keys come from three places, read by each ingress (and direct) replica:

- ``api_keys.env`` (comma-separated) and ``api_keys.file`` (one key per line): each
  key is a caller of its own, in the tenant ``default`` (every model and no limit,
  unless the tenants file names that tenant);
- ``api_keys.tenants_file`` (YAML): named tenants, each with its keys (plain, or
  ``sha256:<hex>`` so that the file holds no key at all) and the models it may use.
  A tenant named ``default`` may have no keys: its models, limits and priority are
  those of the plain keys (and, on an open API, of every request).

The keyring holds SHA-256 digests only: a key is never kept, logged or sent to a
store, and what a caller stores (its Responses) is filed under its owner, the key's
digest or, for a named tenant, the tenant's name (its keys share its responses).
A key is found by its digest in a dict: the time taken depends on the digest of what
the caller sent, which tells it nothing about any real key's bytes, so no
constant-time comparison is needed. A request reads the files again (every
``RELOAD_S`` seconds at most) and a change takes effect at once; a file that has become
invalid or gone keeps the keyring it had, with the error in the log.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

log = logging.getLogger("ray.serve")

# How often a request may look at the files' modification times.
RELOAD_S = 2.0
DEFAULT_TENANT = "default"
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def digest(key: str) -> str:
    return hashlib.sha256(key.strip().encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Whom a key lets in: its tenant, the models it may use (None: all) and the owner
    of what it stores."""

    tenant: str
    owner: str
    models: frozenset[str] | None = None
    requests_per_minute: int | None = None  # None: no limit
    tokens_per_minute: int | None = None  # prompt + max_tokens reserved, then settled
    max_concurrent_requests: int | None = None  # answers under way at once
    priority: int | None = None  # its requests' default and most urgent; None: no bound
    weight: float = 1.0  # its share of a model's engines at capacity (serve/api/common/fairness.py)

    def priority_of(self, requested: int | None) -> int:
        """A request's priority (vLLM's order: lower is admitted first): what it asks,
        never more urgent than its tenant's; the tenant's (else 0) when it asks none."""
        if self.priority is None:
            return requested or 0
        return self.priority if requested is None else max(requested, self.priority)

    def may_use(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models


# The open API's one caller: no keys configured, every request is it.
ANYONE = Caller(tenant=DEFAULT_TENANT, owner="")


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    keys: list[str] = Field(
        default_factory=list,
        description="plain keys, or sha256:<64 hex>; only the default tenant may have none",
    )
    models: list[str] | None = Field(None, min_length=1, description="all when absent")
    requests_per_minute: int | None = Field(None, gt=0, description="no limit when absent")
    tokens_per_minute: int | None = Field(
        None, gt=0, description="prompt and answer tokens; no limit when absent"
    )
    max_concurrent_requests: int | None = Field(
        None, gt=0, description="requests under way at once; no limit when absent"
    )
    priority: int | None = Field(
        None,
        ge=-(2**31),
        lt=2**31,
        description="its requests' default priority and the most urgent they may ask "
        "for (lower first, as vLLM's); absent: 0, and any a request asks",
    )
    weight: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="its share of a model's engines while they are at capacity, against "
        "the other tenants' weights (tokens, by deficit round robin)",
    )

    @model_validator(mode="after")
    def _keys_unless_default(self) -> Tenant:
        if not self.keys and self.name != DEFAULT_TENANT:
            raise ValueError(
                f"tenant {self.name!r} has no keys (only {DEFAULT_TENANT!r}, whose limits "
                "hold the plain keys, may have none)"
            )
        return self

    def caller(self, owner: str | None = None) -> Caller:
        """Whom each of its keys lets in; ``owner``: what it stores is filed under it
        (the tenant's name where None)."""
        return Caller(
            self.name,
            f"tenant:{self.name}" if owner is None else owner,
            frozenset(self.models) if self.models else None,
            self.requests_per_minute,
            self.tokens_per_minute,
            self.max_concurrent_requests,
            self.priority,
            self.weight,
        )

    @field_validator("keys")
    @classmethod
    def _no_blank_key(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if not key.strip():
                raise ValueError("a key is empty")
            if key.startswith("sha256:") and not _DIGEST.fullmatch(key):
                raise ValueError("sha256: must be followed by 64 lowercase hex digits")
        return keys

    def digests(self) -> list[str]:
        return [k[len("sha256:") :] if _DIGEST.fullmatch(k) else digest(k) for k in self.keys]


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[Tenant] = Field(min_length=1)


class TenantsFileError(ValueError):
    """A tenants file that cannot be used, with the file and line that is wrong."""


def load_tenants(path: Path, model_ids: Iterable[str] | None) -> list[Tenant]:
    """The tenants of ``path``, checked: valid YAML of the schema above, no tenant name
    or key twice, only models the app serves (``model_ids``; None: not checked).
    Raises :class:`TenantsFileError` naming the line that is wrong."""
    text = path.expanduser().read_text()
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise TenantsFileError(f"{path}: not YAML: {error}") from None
    try:
        tenants = TenantsFile.model_validate(data).tenants
    except ValidationError as error:
        first = error.errors()[0]
        where = _line(root, first["loc"])
        field = ".".join(str(part) for part in first["loc"])
        raise TenantsFileError(f"{path}:{where}: {field}: {first['msg']}") from None
    known = None if model_ids is None else set(model_ids)
    seen_names: set[str] = set()
    owners: dict[str, str] = {}
    for i, tenant in enumerate(tenants):
        if tenant.name in seen_names:
            raise TenantsFileError(
                f"{path}:{_line(root, ('tenants', i, 'name'))}: tenant {tenant.name!r} twice"
            )
        seen_names.add(tenant.name)
        for j, key_digest in enumerate(tenant.digests()):
            if key_digest in owners:
                where = _line(root, ("tenants", i, "keys", j))
                other = owners[key_digest]
                also = "twice" if other == tenant.name else f"that tenant {other!r} has too"
                raise TenantsFileError(
                    f"{path}:{where}: tenant {tenant.name!r} has a key {also} "
                    "(a key names one tenant, once)"
                )
            owners[key_digest] = tenant.name
        for j, model in enumerate(tenant.models or []):
            if known is not None and model not in known:
                where = _line(root, ("tenants", i, "models", j))
                raise TenantsFileError(
                    f"{path}:{where}: tenant {tenant.name!r}: model {model!r} is not one "
                    f"of the app's models ({', '.join(sorted(known))})"
                )
    return tenants


def _line(node, loc: tuple) -> int:
    """The 1-based line of the YAML node at ``loc`` (pydantic's error location), or of
    the deepest node of it that exists."""
    for part in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            child = node.value[part] if part < len(node.value) else None
        if child is None:
            break
        node = child
    return node.start_mark.line + 1 if node is not None else 1


class Keyring:
    """The app's keys, by digest, read again from their files when those change.

    ``plain``: the keys of ``api_keys.env`` (read once: a process's environment does
    not change); ``keys_file`` and ``tenants_file`` are re-read on change; the tenants
    may name only ``model_ids`` (None: not checked)."""

    def __init__(
        self,
        plain: Iterable[str] = (),
        keys_file: Path | None = None,
        tenants_file: Path | None = None,
        model_ids: Iterable[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._plain = frozenset(digest(k) for k in plain if k.strip())
        self._keys_file, self._tenants_file = keys_file, tenants_file
        self._model_ids = None if model_ids is None else tuple(model_ids)
        self._clock = clock
        self._checked_at = clock()
        self._stamps = self._file_stamps()
        # A file that is missing or wrong: raised here.
        self._callers, self._anyone = self._read()

    @property
    def open(self) -> bool:
        """No key configured: the API is open (loopback use)."""
        self._refresh()
        return not self._callers

    def caller(self, key: str | None) -> Caller | None:
        """Whom ``key`` lets in; None for no key or one the keyring does not hold. On
        an open API, everyone (the ``default`` tenant's limits, if the file has it)
        whatever the key."""
        self._refresh()
        if not self._callers:
            return self._anyone
        return self._callers.get(digest(key)) if key and key.strip() else None

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked_at < RELOAD_S:
            return
        self._checked_at = now
        stamps = self._file_stamps()
        if stamps == self._stamps:
            return
        self._stamps = stamps  # a file gone wrong is reported once per change
        try:
            callers, anyone = self._read()
        except (OSError, TenantsFileError) as error:
            log.error("API keys: kept the keys loaded before: %s", error)
            return
        if self._callers and not callers:
            # An API with keys never turns open on its own (a file emptied, or caught
            # between its truncation and its write): only a restart opens it.
            log.error("API keys: kept the keys loaded before: the files now hold none")
            return
        self._callers, self._anyone = callers, anyone
        log.info("API keys reloaded: %d keys", len(callers))

    def _file_stamps(self) -> tuple:
        """The files' bytes (None for one missing): small files, read every RELOAD_S
        at most, and unlike a modification time they miss no change (a rewrite in the
        same clock tick, a Kubernetes Secret's volume swapping its symlink)."""
        stamps = []
        for path in (self._keys_file, self._tenants_file):
            try:
                stamps.append(path.expanduser().read_bytes() if path is not None else None)
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def _read(self) -> tuple[dict[str, Caller], Caller]:
        """The callers by key digest, and whom an open API lets in."""
        tenants = []
        if self._tenants_file is not None:
            tenants = load_tenants(self._tenants_file, self._model_ids)
        named_default = (t for t in tenants if t.name == DEFAULT_TENANT)
        default = next(named_default, None) or Tenant(name=DEFAULT_TENANT)
        # Each plain key stores on its own, under its digest: its caller has its own owner.
        plain = set(self._plain)
        if self._keys_file is not None:
            plain.update(digest(key) for key in read_keys_file(self._keys_file))
        callers = {d: default.caller(owner=d) for d in plain}
        for tenant in tenants:
            caller = tenant.caller()
            for key_digest in tenant.digests():
                if key_digest in callers:
                    raise TenantsFileError(
                        f"{self._tenants_file}: tenant {tenant.name!r} has a key of "
                        "api_keys.env or api_keys.file (a key names one tenant)"
                    )
                callers[key_digest] = caller
        return callers, default.caller(owner="")


def read_keys_file(path: Path) -> list[str]:
    """The keys of a plain keys file: one per line, ``#`` comments and blanks skipped."""
    lines = path.expanduser().read_text().splitlines()
    return [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]


def main() -> None:
    """``python -m serve.api.common.keyring < key``: the ``sha256:`` form of a key, for a
    tenants file that holds no key."""
    import sys

    print(f"sha256:{digest(sys.stdin.read())}")


if __name__ == "__main__":
    main()
