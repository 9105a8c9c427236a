"""The keyring: plain keys and named tenants, their digests, the tenants file's errors
(with the line that is wrong) and its reload when it changes."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from serve.api.common.keyring import (
    ANYONE,
    DEFAULT_TENANT,
    RELOAD_S,
    Keyring,
    TenantsFileError,
    digest,
    load_tenants,
)
from tests.conftest import ROOT

MODELS = ("llm", "embed")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path, text: str):
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_plain_keys_are_callers_of_their_own_in_the_default_tenant(tmp_path):
    keys = write(tmp_path / "keys", "# ops\nkey-a\n\n  key-b  \n")
    keyring = Keyring(plain=["key-c", " "], keys_file=keys)
    a, b, c = (keyring.caller(k) for k in ("key-a", "key-b", "key-c"))
    assert {a.tenant, b.tenant, c.tenant} == {DEFAULT_TENANT}
    assert len({a.owner, b.owner, c.owner}) == 3 and a.owner == digest("key-a")
    assert a.may_use("anything") and not keyring.open
    for wrong in (None, "", "key-d", "sha256:" + digest("key-a")):
        assert keyring.caller(wrong) is None


def test_without_keys_the_api_is_open_to_anyone():
    keyring = Keyring()
    assert keyring.open and keyring.caller(None) == ANYONE and keyring.caller("x") == ANYONE


def test_the_default_tenant_s_limits_hold_the_plain_keys_and_an_open_api(tmp_path):
    tenants = write(
        tmp_path / "tenants.yaml",
        """
        tenants:
          - name: default   # no keys: the plain keys'
            models: [llm]
            requests_per_minute: 60
            priority: 5
          - name: batch
            keys: [batch-1]
        """,
    )
    keyring = Keyring(plain=["ops-1", "ops-2"], tenants_file=tenants, model_ids=MODELS)
    one, two = keyring.caller("ops-1"), keyring.caller("ops-2")
    assert one.tenant == two.tenant == DEFAULT_TENANT
    assert one.requests_per_minute == 60 and one.priority_of(None) == 5
    assert one.may_use("llm") and not one.may_use("embed")
    # Each plain key still stores on its own.
    assert (one.owner, two.owner) == (digest("ops-1"), digest("ops-2"))
    assert keyring.caller("batch-1").requests_per_minute is None
    # No key anywhere: the API is open, every request held to the default tenant's limits.
    only_limits = write(
        tmp_path / "open.yaml", "tenants:\n  - name: default\n    tokens_per_minute: 9\n"
    )
    anyone = Keyring(tenants_file=only_limits).caller(None)
    assert anyone.tokens_per_minute == 9 and anyone.owner == ""


def test_a_tenant_s_keys_plain_or_hashed_share_its_name_models_and_responses(tmp_path):
    tenants = write(
        tmp_path / "tenants.yaml",
        f"""
        tenants:
          - name: search
            keys: [search-1, "sha256:{digest("search-2")}"]
            models: [llm]
          - name: batch
            keys: [batch-1]
        """,
    )
    keyring = Keyring(plain=["ops"], tenants_file=tenants, model_ids=MODELS)
    one, two = keyring.caller("search-1"), keyring.caller("search-2")
    assert one == two and one.tenant == "search" and one.owner == "tenant:search"
    assert one.may_use("llm") and not one.may_use("embed")
    assert keyring.caller("batch-1").may_use("embed")
    assert keyring.caller("ops").tenant == DEFAULT_TENANT
    assert keyring.caller("sha256:" + digest("search-2")) is None  # the digest is no key


@pytest.mark.parametrize(
    "text, line, says",
    [
        ("tenants:\n  - name: a\n    keys: [k1]\n  - name: b\n    keys: [k2, k1]\n", 5, "'a'"),
        ("tenants:\n  - name: a\n    keys: [k1]\n  - name: a\n    keys: [k2]\n", 4, "twice"),
        ("tenants:\n  - name: a\n    keys: [k1]\n    models: [llm, gpt-9]\n", 4, "gpt-9"),
        ("tenants:\n  - name: a\n    keys: []\n", 2, "tenant 'a' has no keys"),
        ("tenants:\n  - name: a\n    priority: 1\n", 2, "tenant 'a' has no keys"),
        ("tenants:\n  - name: a\n    keys: [k1]\n    rpm: 5\n", 4, "rpm"),
        ("tenants:\n  - name: a\n    keys: [k1]\n    weight: 0\n", 4, "greater than 0"),
        ("tenants:\n  - name: a b\n    keys: [k1]\n", 2, "pattern"),
        ("tenants:\n  - name: a\n    keys: ['sha256:abc']\n", 3, "64"),
        ("tenants: [\n", 1, "not YAML"),
    ],
)
def test_a_bad_tenants_file_is_refused_with_the_line_that_is_wrong(tmp_path, text, line, says):
    path = write(tmp_path / "tenants.yaml", text)
    with pytest.raises(TenantsFileError) as refused:
        load_tenants(path, MODELS)
    message = str(refused.value)
    assert says in message, message
    if says != "not YAML":
        assert message.startswith(f"{path}:{line}: "), message


def test_a_key_of_the_plain_keys_cannot_also_be_a_tenant_s(tmp_path):
    tenants = write(tmp_path / "t.yaml", "tenants:\n  - name: a\n    keys: [shared]\n")
    with pytest.raises(TenantsFileError, match="one tenant"):
        Keyring(plain=["shared"], tenants_file=tenants, model_ids=MODELS)


def test_changed_files_take_effect_and_a_broken_one_keeps_the_keys_before(tmp_path, caplog):
    clock = Clock()
    keys = write(tmp_path / "keys", "old\n")
    tenants = write(tmp_path / "t.yaml", "tenants:\n  - name: a\n    keys: [a1]\n")
    keyring = Keyring(keys_file=keys, tenants_file=tenants, model_ids=MODELS, clock=clock)
    write(keys, "new\n")
    assert keyring.caller("old") is not None  # not looked at before RELOAD_S
    clock.now += RELOAD_S
    assert keyring.caller("old") is None and keyring.caller("new") is not None

    write(tenants, "tenants:\n  - name: a\n    keys: [a1, new]\n")  # a key twice
    clock.now += RELOAD_S
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        assert keyring.caller("a1").tenant == "a"  # kept
    assert "kept the keys loaded before" in caplog.text and "new" not in caplog.text
    caplog.clear()
    clock.now += RELOAD_S
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        keyring.caller("a1")
    assert not caplog.text  # reported once, not on every check

    tenants.unlink()
    clock.now += RELOAD_S
    assert keyring.caller("a1").tenant == "a"  # a file gone keeps the keys too


def test_an_api_with_keys_never_turns_open_on_a_reload(tmp_path, caplog):
    clock = Clock()
    keys = write(tmp_path / "keys", "only\n")
    keyring = Keyring(keys_file=keys, clock=clock)
    keys.write_text("")  # emptied, or caught between its truncation and its write
    clock.now += RELOAD_S
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        assert not keyring.open and keyring.caller("anything") is None
    assert keyring.caller("only") is not None and "hold none" in caplog.text


def test_the_module_prints_a_key_s_sha256_form():
    done = subprocess.run(
        [sys.executable, "-m", "serve.api.common.keyring"],
        input="my-key\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert done.stdout.strip() == f"sha256:{digest('my-key')}"


def test_a_keys_file_the_replica_cannot_read_names_the_field_and_what_to_do(tmp_path):
    from serve.api.common.auth import app_keyring
    from serve.config import APIKeys

    missing = tmp_path / "tenants.yaml"
    with pytest.raises(ValueError, match="api_keys: cannot read .*tenants.yaml") as refused:
        app_keyring(APIKeys(env=None, tenants_file=missing))
    assert "every node that runs an ingress replica" in str(refused.value)


def test_a_tenants_weight_is_its_callers_and_one_by_default(tmp_path):
    text = "tenants:\n  - name: a\n    keys: [a1]\n    weight: 2.5\n  - name: b\n    keys: [b1]\n"
    keyring = Keyring(tenants_file=write(tmp_path / "t.yaml", text), model_ids=MODELS)
    assert (keyring.caller("a1").weight, keyring.caller("b1").weight) == (2.5, 1.0)


@pytest.mark.parametrize(
    "replicas, store, tenants, warned",
    [(2, "memory", True, True), (1, "memory", True, False), (2, "redis", True, False),
     (2, "memory", False, False)],
)  # fmt: skip
def test_limits_counted_per_ingress_replica_are_named_at_deploy(replicas, store, tenants, warned):
    from serve.app import counts_per_replica
    from serve.config import AppConfig

    limits = {"store": store} | (
        {"redis_url": "redis://127.0.0.1:6379"} if store == "redis" else {}
    )
    args = {"ingress": {"num_replicas": replicas}, "rate_limits": limits}
    if tenants:
        args["api_keys"] = {"tenants_file": "/etc/tritonllm/tenants.yaml"}
    warning = counts_per_replica(AppConfig.model_validate(args))
    assert (warning is not None) is warned
    if warned:
        assert f"up to {replicas}x" in warning and "rate_limits.store: redis" in warning
