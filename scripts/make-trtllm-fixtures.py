#!/usr/bin/env python3
"""Writes tests/fixtures/trtllm/*.json: bodies of trtllm-serve's `POST /kv_cache_events`.

Usage: scripts/make-trtllm-fixtures.py TRTLLM_CHECKOUT [--out DIR] [--check]

TRTLLM_CHECKOUT is a TensorRT-LLM source tree (github.com/NVIDIA/TensorRT-LLM). Two of its
files are run here, unmodified, with nothing else of TensorRT-LLM imported (its package
`__init__` and `_utils.py` import torch, tensorrt, mpi4py and the C++ bindings; none of
that is needed for the parts used):

- `tensorrt_llm/_utils.py`, class `KVCacheEventSerializer`: what the executor worker runs
  on the C++ `KVCacheEventManager`'s events (`json.dumps(KVCacheEventSerializer.serialize(
  events))`) before `LLM.get_kv_cache_events_async()` hands them to trtllm-serve, whose
  `/kv_cache_events` route returns them as a FastAPI `JSONResponse`. The class is taken
  out of the file with `ast` and executed alone.
- `tensorrt_llm/runtime/kv_cache_hash.py`, `hash_v1_block_key`: TensorRT-LLM's Python
  port of the C++ `BlockKeyHasher::hash` that names every block in the events (TensorRT-
  LLM's tests assert it is bit-exact with the C++ one; this script first checks it gives
  the values those tests expect).

The serializer dispatches on the class name of each event's `data`, so the events are
stand-ins with the names and attributes of the C++ bindings' classes (`KVCacheEvent`,
`KVCacheStoredData`, `KVCacheStoredBlockData`, `UniqueToken`, ...). Which events happen,
in which order, is kvmesh's scenario, written to follow the C++ `KVCacheEventManager` and
`WindowBlockManager::storeBlocks` (see tests/fixtures/trtllm/README.md); it is not a
capture of a running engine.

A body is rendered the way FastAPI's `JSONResponse` renders a list (Starlette:
`json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
separators=(",", ":"))`), after the JSON round trip the worker-to-server path makes.

--check regenerates into memory and fails if any committed file differs.
"""

import argparse
import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "trtllm")

TOKENS_PER_BLOCK = 32
WINDOW = 4096  # max attention window of the served model (its max_seq_len)
PRIMARY, SECONDARY = 0, 1  # cache_level of a block: GPU, host (C++ kPrimaryLevel, kSecondaryLevel)
DEFAULT_PRIORITY = 35  # C++ KvCacheRetentionConfig::kDefaultRetentionPriority

# The values TensorRT-LLM's own tests expect of its v1 block hash
# (test_v2_kv_cache_event_manager_v1_hash_algo_matches_v1_block_key_hash and
# test_v2_kv_cache_event_manager_v1_hash_algo_mixes_cache_salt_id).
HASH_VECTORS = [
    (([1, 2, 3, 4], 0, None, None), 924206229973855),
    (([5, 6], 924206229973855, None, None), 6875034662206558884),
    (([1, 2, 3, 4], 0, None, 123), 6280297290684427985),
    (([5, 6], 6280297290684427985, None, None), 18177682803760873588),
]


# Stand-ins for the C++ bindings' classes (tensorrt_llm.bindings.executor); the names are
# what KVCacheEventSerializer dispatches on, the fields what it reads.
@dataclasses.dataclass
class UniqueToken:
    token_id: int
    token_extra_id: int = 0


@dataclasses.dataclass
class KVCacheCreatedData:
    num_blocks_per_cache_level: list


@dataclasses.dataclass
class KVCacheStoredBlockData:
    block_hash: int
    tokens: list
    lora_id: Optional[int]
    cache_level: int
    priority: int


@dataclasses.dataclass
class KVCacheStoredData:
    parent_hash: Optional[int]
    blocks: list


@dataclasses.dataclass
class KVCacheRemovedData:
    block_hashes: list


@dataclasses.dataclass
class KVCacheEvent:
    event_id: int
    data: object
    window_size: int
    attention_dp_rank: Optional[int]


def load_serializer(checkout):
    path = os.path.join(checkout, "tensorrt_llm", "_utils.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == "KVCacheEventSerializer":
            source = ast.get_source_segment(text, node)
            namespace = {}
            exec(compile(source, path, "exec"), namespace)
            return namespace["KVCacheEventSerializer"], source
    sys.exit(f"{path}: no class KVCacheEventSerializer")


def load_hasher(checkout):
    path = os.path.join(checkout, "tensorrt_llm", "runtime", "kv_cache_hash.py")
    spec = importlib.util.spec_from_file_location("trtllm_kv_cache_hash", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for args, expected in HASH_VECTORS:
        got = module.hash_v1_block_key(*args)
        if got != expected:
            sys.exit(f"{path}: hash_v1_block_key{args} = {got}, TensorRT-LLM's tests expect {expected}")
    with open(path, "rb") as f:
        raw = f.read()
    return module.hash_v1_block_key, hashlib.sha1(b"blob %d\0" % len(raw) + raw).hexdigest()


class EventManager:
    """kvmesh's model of one rank's C++ KVCacheEventManager: one event_id counter for all
    window sizes, removals merged into the previous event while it is a removal of the
    same window, and a bounded queue that drops the oldest events when it overflows."""

    def __init__(self, max_entries=1024, attention_dp_rank=None):
        self.next_id = 0
        self.max_entries = max_entries
        self.rank = attention_dp_rank
        self.pending = []
        self.queue = []

    def add(self, data, window):
        self.pending.append(KVCacheEvent(self.next_id, data, window, self.rank))
        self.next_id += 1

    def removed(self, block_hash, window):
        last = self.pending[-1] if self.pending else None
        if last is not None and last.window_size == window and isinstance(last.data, KVCacheRemovedData):
            last.data.block_hashes.append(block_hash)
        else:
            self.add(KVCacheRemovedData([block_hash]), window)

    def flush(self):
        self.queue.extend(self.pending)
        self.pending = []
        del self.queue[: max(0, len(self.queue) - self.max_entries)]

    def drain(self):
        self.flush()
        events, self.queue = self.queue, []
        return events


class RadixCache:
    """kvmesh's model of one window's reuse tree, as WindowBlockManager::storeBlocks walks
    it: blocks already cached are matched and say nothing; the first new block and all
    after it are stored in one event whose parent is the last matched block (none at the
    root). The last block of a sequence may be partial (fewer tokens than a block)."""

    def __init__(self, hasher, events, window):
        self.hasher = hasher
        self.events = events
        self.window = window
        self.cached = {}  # hash -> parent hash (0 at the root)

    def store(self, tokens, cache_level=PRIMARY):
        parent, new_blocks, event_parent = 0, [], None
        for start in range(0, len(tokens), TOKENS_PER_BLOCK):
            chunk = tokens[start : start + TOKENS_PER_BLOCK]
            block_hash = self.hasher(chunk, parent)
            if block_hash in self.cached and not new_blocks:
                parent = block_hash
                continue
            if not new_blocks:
                event_parent = parent or None
            self.cached[block_hash] = parent
            new_blocks.append(
                KVCacheStoredBlockData(
                    block_hash, [UniqueToken(t) for t in chunk], None, cache_level, DEFAULT_PRIORITY
                )
            )
            parent = block_hash
        if new_blocks:
            self.events.add(KVCacheStoredData(event_parent, new_blocks), self.window)
        return [b.block_hash for b in new_blocks]

    def hashes(self, tokens):
        parent, out = 0, []
        for start in range(0, len(tokens), TOKENS_PER_BLOCK):
            parent = self.hasher(tokens[start : start + TOKENS_PER_BLOCK], parent)
            out.append(parent)
        return out

    def evict(self, block_hash):
        assert block_hash not in self.cached.values(), "only leaf blocks are evicted"
        del self.cached[block_hash]
        self.events.removed(block_hash, self.window)


def span(first, count):
    return list(range(first, first + count))


def scenarios(hasher):
    """Yields (file name, events drained by one poll)."""
    # One engine, one rank, one attention window: a whole session, poll by poll.
    ev = EventManager()
    cache = RadixCache(hasher, ev, WINDOW)
    ev.add(KVCacheCreatedData([2048, 0]), WINDOW)
    yield "single-01-created.json", ev.drain()

    prompt_a = span(1000, 80)  # two full blocks and a partial one of 16 tokens
    prompt_b = span(1000, 32) + span(2000, 48)  # shares A's first block
    cache.store(prompt_a)
    cache.store(prompt_b)
    yield "single-02-stored.json", ev.drain()

    a0, a1, a2 = cache.hashes(prompt_a)
    _, b1, b2 = cache.hashes(prompt_b)
    cache.evict(a2)
    cache.evict(a1)
    cache.store(span(3000, 64))
    cache.evict(b2)
    yield "single-03-evicted.json", ev.drain()

    yield "single-04-empty.json", ev.drain()

    # A's second block again: the same tokens under the same parent get the same hash.
    cache.store(span(1000, 64) + span(4000, 32))
    yield "single-05-restored.json", ev.drain()

    # The engine restarted: a new manager, event ids from 0 again.
    ev = EventManager()
    ev.add(KVCacheCreatedData([2048, 0]), WINDOW)
    RadixCache(hasher, ev, WINDOW).store(span(5000, 32))
    yield "single-06-restarted.json", ev.drain()

    # event_buffer_max_size 2: the first poll gets the created event; by the second, four
    # stored events have come in two iterations and the queue kept the last two (ids 3, 4).
    ev = EventManager(max_entries=2)
    cache = RadixCache(hasher, ev, WINDOW)
    ev.add(KVCacheCreatedData([2048, 0]), WINDOW)
    yield "overflow-01-created.json", ev.drain()
    cache.store(span(6000, 32))
    cache.store(span(6100, 32))
    ev.flush()
    cache.store(span(6200, 32))
    cache.store(span(6300, 32))
    yield "overflow-02-dropped.json", ev.drain()

    # Attention data parallelism, two ranks: rank 0's manager gathers rank 1's events, each
    # rank numbering its own; every event carries attention_dp_rank.
    ranks = [EventManager(attention_dp_rank=r) for r in (0, 1)]
    caches = [RadixCache(hasher, m, WINDOW) for m in ranks]
    for m in ranks:
        m.add(KVCacheCreatedData([1024, 0]), WINDOW)
    caches[0].store(span(7000, 64))
    caches[1].store(span(7000, 32) + span(7500, 32))
    caches[1].evict(caches[1].hashes(span(7000, 32) + span(7500, 32))[1])
    yield "adp-01.json", ranks[0].drain() + ranks[1].drain()

    # Variable sliding window attention (e.g. layers of window 512 and 4096): one created
    # event per window, the same blocks stored under each, the short window evicting first.
    ev = EventManager()
    short, full = RadixCache(hasher, ev, 512), RadixCache(hasher, ev, WINDOW)
    ev.add(KVCacheCreatedData([4096, 0]), 512)
    ev.add(KVCacheCreatedData([2048, 0]), WINDOW)
    tokens = span(8000, 64)
    short.store(tokens)
    full.store(tokens)
    for block_hash in reversed(short.hashes(tokens)):
        short.evict(block_hash)
    yield "vswa-01.json", ev.drain()


def render(serializer, events):
    # Worker: json.dumps(serialize(events)); LLM side: json.loads; server: JSONResponse.
    content = json.loads(json.dumps(serializer.serialize(events)))
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", help="TensorRT-LLM source tree")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="compare with the files in --out")
    args = parser.parse_args()

    serializer, serializer_source = load_serializer(args.checkout)
    hasher, hash_blob = load_hasher(args.checkout)
    print(f"KVCacheEventSerializer source sha256 {hashlib.sha256(serializer_source.encode()).hexdigest()}")
    print(f"kv_cache_hash.py git blob {hash_blob}")

    stale = []
    for name, events in scenarios(hasher):
        body = render(serializer, events)
        path = os.path.join(args.out, name)
        if args.check:
            with open(path, "rb") as f:
                if f.read() != body:
                    stale.append(name)
        else:
            with open(path, "wb") as f:
                f.write(body)
        print(f"{name}: {len(events)} events, {len(body)} bytes")
    if stale:
        sys.exit(f"differ from a fresh run: {', '.join(stale)}")


if __name__ == "__main__":
    main()
