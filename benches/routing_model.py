#!/usr/bin/env python3
"""An offline model of `routing-quality.sh`'s trace lane, to rank routing ideas in seconds
before measuring them for real (docs/BENCHMARKS.md, *Routing quality: analysis of the
2026-11-26 09:45 run*, which checks it against the measured lanes and shows where it misleads).

It replays a Mooncake-format trace (`timestamp` ms, `input_length`, `output_length`,
`hash_ids` of 512-token blocks) in engine time against N engines that follow engine-sim's
scheduler (vLLM v1: running sequences first, then waiting ones admitted FCFS with chunked
prefill in an 8,192-token budget; a prefix cache of 16,384 64-token blocks, counted here in
512-token blocks, freed blocks evicted least recently used) and its timing model (Dynamo's
mocker polynomials). A router policy picks each request's engine at its arrival:

- `rr`: round robin;
- `cache_aware`: sglang-router's `cache_aware` (balance by in-flight requests when the
  spread exceeds 64 and 1.5x, else the longest match in its own 120 s tree of routed
  prefixes if it covers over 30 % of the prompt, else the smallest tree);
- `kv`: kvmesh's `policy: kv` defaults (the predicted time to first token: the prefill queued
  ahead, less the oldest request's progress, plus the request's uncached tokens in 8,192-token
  iterations, plus the decode work of each iteration; the overlap is the longer of the
  engine's cache and the proxy's decisions of the last 120 s), with exact speeds and instant
  KV events.

What it leaves out: every wall-clock effect (CPU contention, the proxy's overhead, event
delays), learned speeds, engine load reports, preemption. Standard library only.
"""

import argparse
import heapq
import json
import random
from collections import OrderedDict

BLOCK = 512
CAPACITY = 16384 * 64 // BLOCK
BUDGET = 8192


def prefill_ms(tokens):
    """One iteration prefilling `tokens` (engine-sim's timing model at speed-up 1)."""
    if tokens == 0:
        return 0.0
    return 4.209989e-7 * tokens * tokens + 0.01518344 * tokens + 16.50142


def decode_ms(usage):
    """What running sequences add to an iteration at KV usage `usage` (0..1)."""
    return max(1.0, -25.74 * usage * usage + 54.01 * usage + 5.74)


def chunked_ms(tokens):
    """Prefilling `tokens` in full iterations: the time and the iterations."""
    full, rest = divmod(tokens, BUDGET)
    return full * prefill_ms(BUDGET) + prefill_ms(rest), full + (1 if rest else 0)


class Request:
    __slots__ = ("arrival", "isl", "osl", "hashes", "engine", "computed", "generated",
                 "first", "hit", "blocks", "done")

    def __init__(self, arrival, isl, osl, hashes):
        self.arrival, self.isl, self.osl, self.hashes = arrival, isl, osl, hashes
        self.engine = None
        self.computed = self.generated = self.hit = 0
        self.first = None
        self.blocks = []
        self.done = False


class Engine:
    """One engine: queues, a ref-counted prefix cache with an LRU of free blocks."""

    def __init__(self, index):
        self.index = index
        self.waiting = []
        self.running = []
        self.free = OrderedDict()
        self.refs = {}
        self.anonymous = 0
        self.busy = False
        self.plan = None
        self.hit_tokens = self.query_tokens = 0

    def used(self):
        return len(self.refs) + self.anonymous

    def cached_prefix(self, hashes):
        return leading(hashes, lambda h: h in self.refs or h in self.free)

    def make_room(self):
        while self.used() + len(self.free) + 1 > CAPACITY and self.free:
            self.free.popitem(last=False)

    def take(self, h):
        if h in self.refs:
            self.refs[h] += 1
            return
        if h in self.free:
            del self.free[h]
        else:
            self.make_room()
        self.refs[h] = 1

    def add_anonymous(self, request):
        self.make_room()
        self.anonymous += 1
        request.blocks.append(None)

    def release(self, request):
        for h in request.blocks:
            if h is None:
                self.anonymous -= 1
                continue
            self.refs[h] -= 1
            if self.refs[h] == 0:
                del self.refs[h]
                self.free[h] = None
        request.blocks = []

    def schedule(self):
        """Plans an iteration; returns its length in ms (0: nothing to do)."""
        budget = BUDGET
        plan = []
        for r in self.running:
            n = min(r.isl - r.computed if r.computed < r.isl else 1, budget)
            if n:
                plan.append((r, n))
                budget -= n
        while budget > 0 and self.waiting:
            r = self.waiting.pop(0)
            limit = min((r.isl - 1) // BLOCK, len(r.hashes))
            hit = self.cached_prefix(r.hashes[:limit])
            self.query_tokens += r.isl
            self.hit_tokens += hit * BLOCK
            r.hit = hit * BLOCK
            for h in r.hashes[:hit]:
                self.take(h)
            r.blocks = list(r.hashes[:hit])
            r.computed = hit * BLOCK
            self.running.append(r)
            n = min(r.isl - r.computed, budget)
            plan.append((r, n))
            budget -= n
        self.plan = plan
        prefill = sum(n for r, n in plan if r.computed < r.isl)
        return prefill_ms(prefill) + (decode_ms(self.used() / CAPACITY) if self.running else 0.0)

    def complete(self, now, first_token):
        for r, n in self.plan:
            if r.computed < r.isl:
                r.computed += n
                full = min(r.computed // BLOCK, len(r.hashes))
                while len(r.blocks) < full:
                    h = r.hashes[len(r.blocks)]
                    self.take(h)
                    r.blocks.append(h)
                if r.computed >= r.isl:
                    if r.isl % BLOCK:
                        self.add_anonymous(r)
                    r.first, r.generated = now, 1
                    first_token(r, now)
            else:
                r.generated += 1
                if r.generated % BLOCK == 0:
                    self.add_anonymous(r)
            r.done = r.computed >= r.isl and r.generated >= r.osl
        for r in self.running:
            if r.done:
                self.release(r)
        self.running = [r for r in self.running if not r.done]
        self.plan = None


class RoundRobin:
    name = "round robin"

    def setup(self, engines):
        self.engines, self.next = engines, 0

    def route(self, request, now):
        self.next = (self.next + 1) % len(self.engines)
        return self.next

    def first_token(self, request, now):
        pass

    def ended(self, engine, now):
        pass


class CacheAware:
    name = "cache_aware (sglang-router)"

    def __init__(self, threshold=0.3, balance_abs=64, balance_rel=1.5, ttl_ms=120_000.0):
        self.threshold, self.abs, self.rel, self.ttl = threshold, balance_abs, balance_rel, ttl_ms

    def setup(self, engines):
        self.trees = [{} for _ in engines]
        self.in_flight = [set() for _ in engines]

    def route(self, request, now):
        loads = [len(s) for s in self.in_flight]
        if max(loads) - min(loads) > self.abs and max(loads) > self.rel * min(loads):
            k = loads.index(min(loads))
        else:
            matches = [unexpired_prefix(tree, request.hashes, now) for tree in self.trees]
            best = max(matches)
            if best / max(1, len(request.hashes)) > self.threshold:
                k = matches.index(best)
            else:
                sizes = [sum(1 for t in tree.values() if t > now) for tree in self.trees]
                k = sizes.index(min(sizes))
        for h in request.hashes:
            self.trees[k][h] = now + self.ttl
        self.in_flight[k].add(request)
        return k

    def first_token(self, request, now):
        pass

    def ended(self, engine, now):
        self.in_flight[engine.index] = {r for r in self.in_flight[engine.index] if not r.done}


def leading(hashes, present):
    """How many of `hashes`, from the first, are `present`."""
    n = 0
    for h in hashes:
        if not present(h):
            break
        n += 1
    return n


def unexpired_prefix(expiries, hashes, now):
    """Leading `hashes` whose expiry in `expiries` is after `now`."""
    return leading(hashes, lambda h: expiries.get(h, 0.0) > now)


class KvCost:
    def __init__(self, overlap_weight=1.0, work_weight=0.0, decay=True, ttl_ms=120_000.0):
        self.w, self.work, self.decay, self.ttl = overlap_weight, work_weight, decay, ttl_ms
        self.name = "kvmesh kv" + ("" if decay else ", no prefill progress") + (
            f", overlap_weight {overlap_weight}" if overlap_weight != 1.0 else "") + (
            f", work {work_weight}" if work_weight else "")

    def setup(self, engines):
        self.engines = engines
        self.decided = [{} for _ in engines]
        self.prefill = [{} for _ in engines]
        self.in_flight = [set() for _ in engines]
        self.last_first = [None] * len(engines)

    def queued(self, k, now):
        bookings = self.prefill[k]
        total = sum(tokens for tokens, _, _ in bookings.values())
        if self.decay and bookings:
            tokens, own_ms, booked = min(bookings.values(), key=lambda b: b[2])
            began = booked if self.last_first[k] is None else max(booked, self.last_first[k])
            if own_ms > 0:
                total -= int(tokens * min(1.0, (now - began) / own_ms))
        return total

    def cost(self, k, request, now):
        overlap = max(self.engines[k].cached_prefix(request.hashes),
                      unexpired_prefix(self.decided[k], request.hashes, now))
        new = max(1, request.isl - min(overlap * BLOCK, request.isl))
        active = set()
        for r in self.in_flight[k]:
            active.update(r.hashes)
        shared = leading(request.hashes, active.__contains__)
        usage = min(1.0, (len(active) + len(request.hashes) - shared) / CAPACITY)
        running = bool(self.in_flight[k])
        queue_ms, iterations = chunked_ms(self.queued(k, now) + new)
        own_ms, own_iterations = chunked_ms(new)
        per_iteration = decode_ms(usage) if running else 0.0
        value = self.w * queue_ms + iterations * per_iteration + self.work * own_ms
        return value, new, own_ms + own_iterations * per_iteration

    def route(self, request, now):
        best = None
        for k in range(len(self.engines)):
            value, new, own_ms = self.cost(k, request, now)
            key = (value, len(self.in_flight[k]), random.random())
            if best is None or key < best[0]:
                best = (key, k, new, own_ms)
        _, k, new, own_ms = best
        for h in request.hashes:
            self.decided[k][h] = now + self.ttl
        self.prefill[k][request] = (new, own_ms, now)
        self.in_flight[k].add(request)
        return k

    def first_token(self, request, now):
        if self.prefill[request.engine].pop(request, None) is not None:
            self.last_first[request.engine] = now

    def ended(self, engine, now):
        self.in_flight[engine.index] = {r for r in self.in_flight[engine.index] if not r.done}


def replay(policy, requests, engines):
    engines = [Engine(k) for k in range(engines)]
    policy.setup(engines)
    events = [(r.arrival, i, 0, r) for i, r in enumerate(requests)]
    heapq.heapify(events)
    order = len(events)
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == 0:
            item.engine = policy.route(item, now)
            engine = engines[item.engine]
            engine.waiting.append(item)
            if engine.busy:
                continue
        else:
            engine = item
            engine.complete(now, policy.first_token)
            policy.ended(engine, now)
        length = engine.schedule() if engine.running or engine.waiting else None
        engine.busy = length is not None
        if engine.busy:
            order += 1
            heapq.heappush(events, (now + length, order, 1, engine))
    return engines


def load(path, limit, speedup):
    requests = []
    with open(path) as f:
        for line in f:
            if len(requests) == limit:
                break
            d = json.loads(line)
            requests.append(Request(d["timestamp"] / speedup, d["input_length"],
                                    max(1, d["output_length"]), d["hash_ids"]))
    return requests


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--slice-requests", type=int, default=2000)
    ap.add_argument("--arrival-speedup", type=float, default=4.0)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    policies = [RoundRobin(), CacheAware(), KvCost(decay=False), KvCost(),
                KvCost(overlap_weight=2.0), KvCost(work_weight=1.0)]
    print("| policy | TTFT p50 | TTFT p90 | TTFT p99 | hit rate | requests per engine |")
    print("|---|---:|---:|---:|---:|---:|")
    for policy in policies:
        random.seed(args.seed)
        requests = load(args.trace, args.slice_requests, args.arrival_speedup)
        engines = replay(policy, requests, args.engines)
        ttft = sorted(r.first - r.arrival for r in requests)
        q = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))]
        hits = sum(e.hit_tokens for e in engines) / max(1, sum(e.query_tokens for e in engines))
        per = [0] * args.engines
        for r in requests:
            per[r.engine] += 1
        print(f"| {policy.name} | {q(.5):.0f} | {q(.9):.0f} | {q(.99):.0f} | {hits:.3f} "
              f"| {min(per)}–{max(per)} |", flush=True)


if __name__ == "__main__":
    main()
