"""The stored-responses stores: the memory store's bounds (bytes, least recently used
first; age), its Serve deployment and the adapter over its handle, the config, and
the Redis store against a real redis-server (``make redis``)."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
import yaml
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve.api.common.errors import Overloaded
from serve.api.openai.responses.store import (
    DEFAULT_KEY_PREFIX,
    MemoryStore,
    RecordTooLarge,
    RedisStore,
    to_json,
)
from serve.app import response_store
from serve.config import AppConfig, ResponsesConfig
from serve.deployments.response_store import (
    DeploymentStore,
    ResponseStoreReplica,
    open_response_store,
)
from tests.conftest import ROOT
from tests.integration.cluster import RedisServer


def run(coroutine):
    return asyncio.run(coroutine)


def record(n: int, padding: int = 0) -> dict:
    return {"id": f"resp_{n}", "output": [{"text": "x" * padding}]}


def size(value: dict) -> int:
    return len(to_json(value).encode())


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the memory store ---


def test_memory_store_puts_gets_overwrites_and_deletes():
    store = MemoryStore(max_bytes=10_000, ttl_s=60)
    assert run(store.get("resp_1")) is None
    run(store.put("resp_1", record(1)))
    assert run(store.get("resp_1")) == record(1)
    run(store.put("resp_1", record(1, padding=5)))  # overwrites
    assert run(store.get("resp_1")) == record(1, padding=5)
    assert len(store) == 1 and store.size == size(record(1, padding=5))
    assert run(store.delete("resp_1")) is True
    assert run(store.delete("resp_1")) is False
    assert run(store.get("resp_1")) is None and store.size == 0


def test_a_stored_record_does_not_change_with_the_callers_dict():
    store = MemoryStore(max_bytes=10_000, ttl_s=60)
    mine = record(1)
    run(store.put("resp_1", mine))
    mine["output"].append("later")
    mine["id"] = "changed"
    read = run(store.get("resp_1"))
    assert read == record(1)
    read["id"] = "changed too"  # nor with a reader's copy
    assert run(store.get("resp_1")) == record(1)


def test_the_least_recently_used_record_goes_first_when_the_bytes_run_out():
    one = size(record(1, padding=100))
    store = MemoryStore(max_bytes=3 * one, ttl_s=60)
    for n in (1, 2, 3):
        run(store.put(f"resp_{n}", record(n, padding=100)))
    assert run(store.get("resp_1")) is not None  # 1 is now more recent than 2
    run(store.put("resp_4", record(4, padding=100)))
    assert run(store.get("resp_2")) is None
    assert all(run(store.get(f"resp_{n}")) for n in (1, 3, 4))
    # One record twice the size makes room for itself: 1 then 3 (the least recent) go.
    run(store.put("resp_5", record(5, padding=100 + one)))
    assert store.size == 3 * one
    assert run(store.get("resp_3")) is None and run(store.get("resp_1")) is None
    assert run(store.get("resp_4")) is not None and run(store.get("resp_5")) is not None


def test_a_record_larger_than_the_store_is_refused_and_nothing_is_evicted():
    store = MemoryStore(max_bytes=500, ttl_s=60)
    run(store.put("resp_1", record(1)))
    with pytest.raises(RecordTooLarge, match="resp_2: .* bytes of JSON, more than the store's 500"):
        run(store.put("resp_2", record(2, padding=500)))
    assert run(store.get("resp_1")) == record(1) and run(store.get("resp_2")) is None
    assert issubclass(RecordTooLarge, ValueError)


def test_the_size_is_the_records_utf8_json():
    store = MemoryStore(max_bytes=10_000, ttl_s=60)
    answer = {"text": "héllo ✓ 你好"}
    run(store.put("resp_1", answer))
    assert store.size == len('{"text":"héllo ✓ 你好"}'.encode()) == 28  # UTF-8, not \u escapes
    assert run(store.get("resp_1")) == answer
    run(store.delete("resp_1"))
    assert store.size == 0


def test_records_expire_ttl_after_their_put_and_a_get_does_not_extend_that():
    clock = Clock()
    store = MemoryStore(max_bytes=10_000, ttl_s=10, clock=clock)
    run(store.put("resp_1", record(1)))
    clock.now += 5
    run(store.put("resp_2", record(2)))
    clock.now += 4.9
    assert run(store.get("resp_1")) == record(1)  # read at 9.9 s
    clock.now += 0.1
    assert run(store.get("resp_1")) is None  # 10 s after its put, read or not
    assert run(store.get("resp_2")) == record(2)
    run(store.put("resp_2", record(2, padding=3)))  # a put starts its time anew
    clock.now += 9.9
    assert run(store.get("resp_2")) == record(2, padding=3)
    assert run(store.delete("resp_2")) is True
    clock.now += 100
    assert store.size == 0 and len(store) == 0


def test_expired_records_free_their_bytes_before_any_live_one_is_evicted():
    clock = Clock()
    one = size(record(1, padding=100))
    store = MemoryStore(max_bytes=2 * one, ttl_s=10, clock=clock)
    run(store.put("resp_1", record(1, padding=100)))
    clock.now += 5
    run(store.put("resp_2", record(2, padding=100)))
    run(store.get("resp_1"))  # most recent, but the older put
    clock.now += 5
    run(store.put("resp_3", record(3, padding=100)))
    assert run(store.get("resp_1")) is None  # expired, though recently used
    assert run(store.get("resp_2")) is not None and run(store.get("resp_3")) is not None


# --- the Serve deployment and the adapter over its handle ---


def test_the_deployment_class_keeps_json_texts():
    replica = ResponseStoreReplica(max_bytes=1000, ttl_s=60)
    run(replica.put("resp_1", '{"a":1}'))
    assert run(replica.get("resp_1")) == '{"a":1}'
    assert run(replica.delete("resp_1")) is True
    assert run(replica.get("resp_1")) is None and run(replica.delete("resp_1")) is False


class _Method:
    """One method of a fake DeploymentHandle: ``.remote`` calls the replica, or fails."""

    def __init__(self, replica, name, fails: Exception | None):
        self._call, self._fails = getattr(replica, name, None), fails

    def remote(self, *args):
        async def answer():
            if self._fails is not None:
                raise self._fails
            return await self._call(*args)

        return answer()


class FakeHandle:
    def __init__(self, replica, fails: Exception | None = None):
        self.put, self.get, self.delete = (
            _Method(replica, n, fails) for n in ("put", "get", "delete")
        )


def test_the_deployment_store_round_trips_records_through_the_replica():
    replica = ResponseStoreReplica(max_bytes=1000, ttl_s=60)
    store = DeploymentStore(FakeHandle(replica))
    mine = record(1)
    run(store.put("resp_1", mine))
    mine["id"] = "changed"
    assert run(replica.get("resp_1")) == to_json(record(1))  # text crosses, not the dict
    assert run(store.get("resp_1")) == record(1)
    assert run(store.delete("resp_1")) is True and run(store.get("resp_1")) is None


def remote_failure(cause: Exception) -> RayTaskError:
    """What a handle raises for an exception in the replica (the remote traceback's text)."""
    error = RayTaskError("put", "Traceback (most recent call last): ...", cause)
    return error.as_instanceof_cause()


@pytest.mark.parametrize(
    "failure",
    [
        ActorUnavailableError("the actor is restarting", None),
        DeploymentUnavailableError("ResponseStore"),
        BackPressureError(num_queued_requests=5, max_queued_requests=5),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_unreachable_store_replica_is_a_503_to_retry(failure):
    store = DeploymentStore(FakeHandle(ResponseStoreReplica(1000, 60), fails=failure))
    for call in (store.put("resp_1", record(1)), store.get("resp_1"), store.delete("resp_1")):
        with pytest.raises(Overloaded, match="the response store is not available; retry") as e:
            run(call)
        assert e.value.status == 503 and "Retry-After" in e.value.headers()


def test_a_store_replica_that_does_not_answer_in_time_is_a_503():
    class Hangs:
        async def get(self, response_id):
            await asyncio.sleep(60)

    store = DeploymentStore(FakeHandle(Hangs()), timeout_s=0.05)
    started = time.monotonic()
    with pytest.raises(Overloaded):
        run(store.get("resp_1"))
    assert time.monotonic() - started < 5


def test_a_record_too_large_for_the_replica_keeps_its_own_type_and_message():
    too_large = RecordTooLarge("response resp_1: 2000 bytes of JSON, more than the store's 1000")
    store = DeploymentStore(FakeHandle(None, fails=remote_failure(too_large)))
    with pytest.raises(RecordTooLarge) as error:
        run(store.put("resp_1", record(1)))
    assert str(error.value) == str(too_large) and not isinstance(error.value, RayTaskError)
    # End to end, a real replica's refusal reaches the caller as the same type.
    small = DeploymentStore(FakeHandle(ResponseStoreReplica(max_bytes=10, ttl_s=60)))
    with pytest.raises(RecordTooLarge):
        run(small.put("resp_1", record(1)))


def test_a_fault_in_the_store_replicas_code_is_not_disguised_as_a_retry():
    store = DeploymentStore(FakeHandle(None, fails=remote_failure(KeyError("bug"))))
    with pytest.raises(RayTaskError):
        run(store.get("resp_1"))


# --- the config, and which store the ingress opens ---


def test_the_default_is_the_memory_store_for_thirty_days():
    responses = AppConfig().responses
    assert (responses.store, responses.ttl_s, responses.max_memory_mb) == ("memory", 2592000, 256)
    assert responses.max_memory_bytes() == 256 << 20
    assert responses.key_prefix == DEFAULT_KEY_PREFIX == "tritonllm:responses:"


def test_serve_config_yamls_commented_responses_block_is_the_default():
    text = (ROOT / "serve" / "config.yaml").read_text()
    args = yaml.safe_load(text)["applications"][0]["args"]
    assert AppConfig.model_validate(args).responses == ResponsesConfig()
    (line,) = [line for line in text.splitlines() if line.strip().startswith("# responses:")]
    shown = yaml.safe_load(line.strip().removeprefix("# "))["responses"]
    assert ResponsesConfig.model_validate(shown) == ResponsesConfig()


@pytest.mark.parametrize(
    "fields",
    [{"store": "redis"}, {"store": "redis", "redis_url": "redis://a", "redis_url_env": "URL"}],
)
def test_the_redis_store_needs_exactly_one_url_source(fields):
    with pytest.raises(ValidationError, match="store: redis needs exactly one of redis_url"):
        AppConfig.model_validate({"responses": fields})


@pytest.mark.parametrize(
    "fields", [{"ttl_s": 0}, {"max_memory_mb": -1}, {"store": "disk"}, {"stor": "memory"}]
)
def test_bad_responses_fields_are_refused(fields):
    with pytest.raises(ValidationError):
        ResponsesConfig.model_validate(fields)


def test_the_ingress_opens_the_store_its_config_names():
    handle = FakeHandle(ResponseStoreReplica(1000, 60))
    assert isinstance(open_response_store(ResponsesConfig(), handle), DeploymentStore)
    assert open_response_store(ResponsesConfig(store="none"), handle) is None
    with pytest.raises(ValueError, match="needs the handle of the app's ResponseStore"):
        open_response_store(ResponsesConfig(), None)
    redis = ResponsesConfig(store="redis", redis_url_env="RESPONSES_URL", key_prefix="p:")
    store = open_response_store(redis, environ={"RESPONSES_URL": "redis://127.0.0.1:1/0"})
    assert isinstance(store, RedisStore) and store.key_prefix == "p:"
    with pytest.raises(ValueError, match="RESPONSES_URL, which is unset or empty"):
        open_response_store(redis, environ={"RESPONSES_URL": ""})


def test_the_app_deploys_one_memory_store_replica_only_for_the_memory_store():
    bound = response_store(AppConfig())._bound_deployment
    assert (bound.name, bound.num_replicas) == ("ResponseStore", 1)
    # A token share: it takes no CPU from the replicas, yet stays off a head of none.
    assert 0 < bound.ray_actor_options["num_cpus"] <= 0.01
    assert bound.init_args == (256 << 20, 2592000)
    assert bound.func_or_class is ResponseStoreReplica
    redis = {"store": "redis", "redis_url": "redis://127.0.0.1:6379/0"}
    assert response_store(AppConfig.model_validate({"responses": redis})) is None
    assert response_store(AppConfig.model_validate({"responses": {"store": "none"}})) is None


# --- the Redis store, against a real redis-server ---

HAS_REDIS = (
    bool(shutil.which("redis-server")) or (RedisServer.UNPACKED / "bin/redis-server").exists()
)
needs_redis = pytest.mark.skipif(not HAS_REDIS, reason="no redis-server: run `make redis`")


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


async def _with_stores(server: RedisServer, use, ttl_s: float = 60, count: int = 1):
    stores = [RedisStore(f"redis://{server.address}/0", ttl_s) for _ in range(count)]
    try:
        return await use(*stores)
    finally:
        for store in stores:
            await store.close()


@needs_redis
def test_redis_store_puts_gets_overwrites_and_deletes(redis_server):
    async def use(store):
        assert await store.get("resp_1") is None
        await store.put("resp_1", record(1))
        assert await store.get("resp_1") == record(1)
        await store.put("resp_1", record(1, padding=4))
        assert await store.get("resp_1") == record(1, padding=4)
        assert await store.delete("resp_1") is True
        assert await store.delete("resp_1") is False
        assert await store.get("resp_1") is None

    run(_with_stores(redis_server, use))


@needs_redis
def test_redis_keys_carry_the_prefix_and_redis_expires_them(redis_server):
    import redis.asyncio

    async def use(store):
        await store.put("resp_ttl", record(1))
        raw = redis.asyncio.from_url(f"redis://{redis_server.address}/0")
        try:
            assert await raw.exists("tritonllm:responses:resp_ttl") == 1
            assert 0 < await raw.pttl("tritonllm:responses:resp_ttl") <= 1000
        finally:
            await raw.aclose()
        await asyncio.sleep(1.5)
        assert await store.get("resp_ttl") is None

    run(_with_stores(redis_server, use, ttl_s=1))


@needs_redis
def test_a_new_redis_store_reads_what_an_earlier_one_stored(redis_server):
    """What an ingress replica that restarted (or another one) does."""

    async def first(store):
        await store.put("resp_kept", record(7))

    async def second(store):
        return await store.get("resp_kept")

    run(_with_stores(redis_server, first))
    assert run(_with_stores(redis_server, second)) == record(7)


@needs_redis
def test_a_stopped_redis_is_a_503_to_retry_not_a_raw_error():
    server = RedisServer().start()

    async def use(store):
        await store.put("resp_1", record(1))  # a pooled connection, to a live server
        server.stop()
        for call in (store.get("resp_1"), store.put("resp_2", record(2)), store.delete("x")):
            with pytest.raises(Overloaded, match="the response store is not available"):
                await call

    try:
        run(_with_stores(server, use))
    finally:
        server.stop()
