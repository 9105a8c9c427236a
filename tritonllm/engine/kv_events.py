"""The prefix cache's KV cache events, published as vLLM publishes its own.

A KV-aware router (``routing: kv_aware``: Dynamo's indexer, as Ray Serve LLM and
Dynamo run it) keeps an index of the blocks each engine holds, fed by the engines'
own events rather than by a guess from the prompts each replica was sent. vLLM's
``kv_events_config`` and TensorRT-LLM's ``KVEventsConfig`` publish one format, which
this module speaks for the torch engine:

- a ZMQ PUB socket sends each batch as three frames: the topic, an 8-byte big-endian
  sequence number (from 0 at the engine's start: a subscriber that sees a gap knows it
  lost batches) and the batch, msgpack ``[ts, [event, ...], data_parallel_rank]``, each
  event a tagged map: ``{"type": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_name", ...}``, ``BlockRemoved``, ``AllBlocksCleared``;
- a ZMQ ROUTER socket answers a replay request ``[identity, b"", start_seq]`` with every
  buffered batch from ``start_seq`` on, then an end marker (sequence -1, empty payload).

An indexer never recomputes an engine's hash (Dynamo hashes the ``token_ids`` itself):
a block hash is an id for parent links and removals. The cache names a block by a
counter; the hash published is a chained digest of the block's content (its parent's
hash, its adapter, its tokens), so two engines holding the same prefix publish the
same ids, as vLLM's do under a pinned ``PYTHONHASHSEED``.

Why by hand and not vLLM's ``ZmqEventPublisher``: vLLM is not installed beside Triton
(nor can be: its torch and numpy pins differ), and its publisher is 200 lines bound to
its config classes. What matters, the wire, is pinned by tests against Dynamo's own
indexer (tests/unit/tritonllm/engine/test_kv_events.py).

The engine thread only appends to a queue (a ``SimpleQueue.put``, well under a
microsecond); hashing, encoding and sending run on the publisher's own thread.
"""

from __future__ import annotations

import array
import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Hashable

import msgspec
import zmq

log = logging.getLogger(__name__)


END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


def lora_of(root: Hashable) -> int | None:
    """The LoRA task id a chain's root stands for (None: the base model's chains)."""
    return root[2] if isinstance(root, tuple) else None


class KVEventPublisher:
    """Publishes a prefix cache's stored, removed and cleared blocks (thread-safe: the
    engine thread calls :meth:`stored` and :meth:`removed`)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        block_size: int,
        buffer_batches: int = 10_000,
        topic: str = "",
    ):
        self.block_size = block_size
        self._topic = topic.encode()
        self._context = zmq.Context()
        try:
            self._pub = self._bind(zmq.PUB, endpoint)
            self._replay = self._bind(zmq.ROUTER, replay_endpoint) if replay_endpoint else None
        except zmq.ZMQError:
            self._context.destroy(linger=0)  # the one bound, if any, with it
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._hashes: dict[int, int] = {}  # a cached block's counter id -> its published hash
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._stopping = False
        # A new engine holds nothing: an index that kept an old engine's blocks at this
        # endpoint (a restarted Triton) drops them.
        self._queue.put(_Cleared())
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(endpoint)
        return socket

    # -- the engine thread ----------------------------------------------------

    def stored(self, parent: Hashable, blocks: list[tuple[int, tuple[int, ...]]], root: Hashable):
        """``blocks`` (counter id, tokens), a chain, now cached after ``parent`` (a
        block's id, or ``root`` for a chain's first block)."""
        self._queue.put(("stored", parent, blocks, root))

    def removed(self, block_id: int) -> None:
        self._queue.put(("removed", block_id))

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=2)
        self._context.destroy(linger=0)

    # -- the publisher thread -------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                first = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                first = None
            if first is not None:
                self._publish([first, *self._drain()])
            self._answer_replays()

    def _drain(self) -> list:
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _publish(self, items: list) -> None:
        events = [event for event in map(self._event, items) if event is not None]
        if not events:
            return
        payload = self._encoder.encode(_Batch(time.time(), events))
        seq = self._seq.to_bytes(8, "big")
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self._pub.send_multipart((self._topic, seq, payload), copy=False)

    def _event(self, item) -> _Stored | _Removed | _Cleared | None:
        if isinstance(item, _Cleared):
            self._hashes.clear()
            return item
        if item[0] == "removed":
            digest = self._hashes.pop(item[1], None)
            return _Removed([digest]) if digest is not None else None
        _, parent, blocks, root = item
        parent_hash = None if parent == root else self._hashes.get(parent)
        lora = lora_of(root)
        hashes, tokens, previous = [], [], parent_hash
        for block_id, block_tokens in blocks:
            previous = self._hashes[block_id] = _chain_hash(previous, lora, block_tokens)
            hashes.append(previous)
            tokens.extend(block_tokens)
        return _Stored(
            hashes,
            parent_hash,
            tokens,
            self.block_size,
            lora_id=lora,
            lora_name=None if lora is None else str(lora),
        )

    def _answer_replays(self) -> None:
        """Each waiting replay request: the buffered batches from its start on."""
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("KV events: a replay request of %d frames ignored", len(frames))
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


def _chain_hash(parent: int | None, lora: int | None, tokens: tuple[int, ...]) -> int:
    """63 bits of a digest of the whole prefix up to this block (an indexer reads the
    hash as a signed or unsigned 64-bit int)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((parent or 0).to_bytes(8, "big"))
    digest.update((lora or 0).to_bytes(8, "big"))
    digest.update(array.array("I", tokens).tobytes())
    return int.from_bytes(digest.digest(), "big") >> 1


def publisher_at(endpoints: str, block_size: int) -> KVEventPublisher | None:
    """The publisher at ``endpoints`` ("PUB,REPLAY", as ``contract.KV_EVENTS_ENDPOINTS_ENV`` gives
    them), or None where they cannot be bound (logged: the engine serves without)."""
    endpoint, _, replay = endpoints.partition(",")
    try:
        return KVEventPublisher(endpoint, replay or None, block_size)
    except zmq.ZMQError as error:
        log.warning("KV events not published: cannot bind %s: %s", endpoints, error)
        return None
