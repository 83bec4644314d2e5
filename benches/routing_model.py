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
  iterations, plus what the streams running there add to each iteration and the wait for
  the decode step in flight, plus the request's own tokens' prefill once more per request
  queued there (`kv.queue_weight`) and twice more whatever waits (`kv.work_weight`); the
  overlap is the longer of the engine's cache and the proxy's decisions of the last 120 s),
  with exact speeds and instant KV events.

With `--replicas N` the `kv` rows are run by N proxy replicas that share what kvmesh's
replicas share, a share delay late (`ReplicatedKv`); `--replica-sweep` compares replica
counts with one replica (docs/BENCHMARKS.md, *Routing quality: replicas in the offline model
(issue 31)*).

What it leaves out: every wall-clock effect (CPU contention, the proxy's overhead, event
delays), learned speeds, engine load reports, preemption. Standard library only.
"""

import argparse
import heapq
import json
import math
import random
from collections import OrderedDict

BLOCK = 512
CAPACITY = 16384 * 64 // BLOCK
BUDGET = 8192


PREFILL_FIXED_MS = 16.50142


def prefill_ms(tokens):
    """One iteration prefilling `tokens` (engine-sim's timing model at speed-up 1)."""
    if tokens == 0:
        return 0.0
    return 4.209989e-7 * tokens * tokens + 0.01518344 * tokens + PREFILL_FIXED_MS


DECODE_IDLE_MS = 5.74


def decode_ms(usage):
    """What running sequences add to an iteration at KV usage `usage` (0..1)."""
    return max(1.0, -25.74 * usage * usage + 54.01 * usage + DECODE_IDLE_MS)


def running_streams_ms(usage, running):
    """What `kv`'s cost charges for streams running on an engine (route/src/kv/cost.rs): they
    ride in each prefill iteration, adding the decode step's part above an idle cache's, and
    the request first waits half the decode step in flight. Returns (per iteration, wait)."""
    if not running:
        return 0.0, 0.0
    step = decode_ms(usage)
    return step - DECODE_IDLE_MS, 0.5 * step


def chunked_ms(tokens):
    """Prefilling `tokens` in full iterations: the time and the iterations."""
    full, rest = divmod(tokens, BUDGET)
    return full * prefill_ms(BUDGET) + prefill_ms(rest), full + (1 if rest else 0)


def tokens_ms(time_ms, iterations):
    """The per-token part of `iterations` prefill iterations taking `time_ms`: without each
    iteration's fixed part (what `kv.queue_weight` and `kv.work_weight` charge)."""
    return time_ms - iterations * PREFILL_FIXED_MS


class Request:
    __slots__ = ("arrival", "isl", "osl", "hashes", "engine", "computed", "generated",
                 "first", "hit", "blocks", "done", "extra")

    def __init__(self, arrival, isl, osl, hashes):
        self.arrival, self.isl, self.osl, self.hashes = arrival, isl, osl, hashes
        self.engine = None
        self.computed = self.generated = self.hit = 0
        self.first = None
        self.blocks = []
        self.done = False
        # Milliseconds the decision itself took (a round trip to the leader), added to TTFT.
        self.extra = 0.0


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
    def __init__(self, overlap_weight=1.0, work_weight=2.0, decay=True, ttl_ms=120_000.0,
                 queue_weight=1.0):
        self.w, self.work, self.decay, self.ttl = overlap_weight, work_weight, decay, ttl_ms
        self.queue = queue_weight
        self.name = "kvmesh kv" + ("" if decay else ", no prefill progress") + (
            f", overlap_weight {overlap_weight}" if overlap_weight != 1.0 else "") + (
            f", work_weight {work_weight}" if work_weight != 2.0 else "") + (
            f", queue_weight {queue_weight}" if queue_weight != 1.0 else "")

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
        per_iteration, wait = running_streams_ms(usage, running)
        value = self.w * queue_ms + iterations * per_iteration + wait
        # kv.queue_weight: its tokens' prefill for each request queued there; kv.work_weight:
        # its tokens' prefill once, whatever waits there.
        own_tokens_ms = tokens_ms(own_ms, own_iterations)
        value += (self.queue * len(self.prefill[k]) + self.work) * own_tokens_ms
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


def draw(costs, temperature):
    """kvmesh's choice at `temperature` > 0 (route/src/kv/select.rs): `p(i) ∝
    exp(−((cost(i) − min) / (max − min)) / T)`, uniform when all costs are equal."""
    low, high = min(costs), max(costs)
    if not high - low > 1e-9:
        return int(random.random() * len(costs))
    weights = [math.exp(-((c - low) / (high - low)) / temperature) for c in costs]
    x = random.random() * sum(weights)
    for k, w in enumerate(weights):
        if x < w:
            return k
        x -= w
    return len(costs) - 1


class Replica:
    """What one proxy replica knows: its own bookings, in-flight requests and their blocks, the
    decisions it recorded (its own and those the others shared), and where it has read the
    shared decision log up to."""

    def __init__(self, engines):
        self.decided = [{} for _ in engines]
        self.prefill = [{} for _ in engines]
        self.in_flight = [set() for _ in engines]
        self.blocks = [{} for _ in engines]
        self.last_first = [None] * len(engines)
        self.read = 0


class ReplicatedKv(KvCost):
    """`kv` run by `replicas` proxy replicas over the same engines, each routing the requests
    that reach it (`spread`) with what it knows (route/src/kv/replicas.rs, the control plane's
    Sharer): its own bookings exactly, every engine's cache at once (every replica reads every
    KV event), the other replicas' routing decisions `delay_ms` after they were made (recorded
    as its own, for the same 120 s), and their in-flight load as they share it at every change,
    `delay_ms` late: per instance, the prefill tokens booked and not yet answered (whole: the
    oldest request's progress is decayed only for a replica's own requests, as the
    instance's own first tokens teach it), the distinct blocks held (summed over replicas, a
    prefix two replicas both hold counted twice) and the requests.

    `share="bookings"` models sharing each booking instead of the totals (a shared in-flight
    index): every replica sees the others' requests themselves, `delay_ms` late, so it decays
    the instance's oldest prefill whoever booked it, counts a shared prefix once and breaks
    ties on every replica's requests. With `delay_ms` 0 it routes as one proxy does.
    """

    def __init__(self, replicas, delay_ms=1.0, spread="lanes", share="loads", decide="own",
                 temperature=0.0, **kwargs):
        super().__init__(**kwargs)
        self.count, self.delay, self.spread, self.share = replicas, delay_ms, spread, share
        self.decide, self.temperature = decide, temperature
        # A leader deciding for every replica: one proxy's decisions, each a round trip late.
        self.extra_ms = 2 * delay_ms if decide == "leader" and replicas > 1 else 0.0
        self.name += f", {replicas} replicas"

    def setup(self, engines):
        super().setup(engines)
        self.replicas = [Replica(engines) for _ in range(self.count)]
        self.log = []
        nothing = (float("-inf"), 0, 0, 0, (), frozenset(), None)
        self.shares = [[[nothing] for _ in engines] for _ in range(self.count)]
        self.owner = {}
        self.arrived = 0
        self.idle = []
        self.connections = 0

    def reach(self, request):
        """The replica the next request reaches. `lanes`: as kvmesh-bench spreads it, one
        request at a time per connection, the most recently freed connection first, a new one
        when none is free, new connections opened on each replica in turn; `request`: each
        request to the next replica in turn. A `leader` decides every request itself."""
        if self.decide == "leader":
            return 0
        if self.spread == "request":
            return self.arrived % self.count
        if self.idle:
            return self.idle.pop()
        self.connections += 1
        return (self.connections - 1) % self.count

    def publish(self, j, k, now):
        """Replica `j` shares its load on engine `k` as it is at `now`."""
        me = self.replicas[j]
        exact = self.share == "bookings"
        entry = (now, sum(b[0] for b in me.prefill[k].values()), len(me.blocks[k]),
                 len(me.in_flight[k]), tuple(me.prefill[k].values()) if exact else (),
                 frozenset(me.blocks[k]) if exact else frozenset(), me.last_first[k])
        history = self.shares[j][k]
        history.append(entry)
        while len(history) > 1 and history[1][0] <= now - self.delay:
            history.pop(0)

    def seen(self, j, k, at):
        """Replica `j`'s last share of its load on engine `k` that arrived by `at`."""
        for entry in reversed(self.shares[j][k]):
            if entry[0] <= at:
                return entry
        return self.shares[j][k][0]

    def others(self, i, k, now):
        """What replica `i` knows at `now` of the other replicas' load on engine `k`."""
        return [self.seen(j, k, now - self.delay) for j in range(self.count) if j != i]

    def queued_by(self, i, k, now, others):
        me = self.replicas[i]
        if self.share != "bookings":
            return self.queued_own(me, k, now) + sum(o[1] for o in others)
        bookings = list(me.prefill[k].values())
        firsts = [me.last_first[k]]
        for o in others:
            bookings.extend(o[4])
            firsts.append(o[6])
        total = sum(b[0] for b in bookings)
        if self.decay and bookings:
            tokens, own_ms, booked, _ = min(bookings, key=lambda b: (b[2], b[3]))
            known = [f for f in firsts if f is not None]
            began = max([booked] + known)
            if own_ms > 0:
                total -= int(tokens * min(1.0, (now - began) / own_ms))
        return total

    def queued_own(self, me, k, now):
        bookings = me.prefill[k]
        total = sum(b[0] for b in bookings.values())
        if self.decay and bookings:
            tokens, own_ms, booked, _ = min(bookings.values(), key=lambda b: (b[2], b[3]))
            began = booked if me.last_first[k] is None else max(booked, me.last_first[k])
            if own_ms > 0:
                total -= int(tokens * min(1.0, (now - began) / own_ms))
        return total

    def replica_cost(self, i, k, request, now, hidden=0):
        """Replica `i`'s cost of engine `k` for `request` at `now`, as if `hidden` more
        requests like it were queued there unseen."""
        me = self.replicas[i]
        others = self.others(i, k, now)
        overlap = max(self.engines[k].cached_prefix(request.hashes),
                      unexpired_prefix(me.decided[k], request.hashes, now))
        new = max(1, request.isl - min(overlap * BLOCK, request.isl))
        own = me.blocks[k]
        if self.share == "bookings":
            held = set(own)
            for o in others:
                held.update(o[5])
            shared = leading(request.hashes, held.__contains__)
            active = len(held)
        else:
            shared = leading(request.hashes, own.__contains__)
            active = len(own) + sum(o[2] for o in others)
        usage = min(1.0, (active + len(request.hashes) - shared) / CAPACITY)
        requests = sum(o[3] for o in others)
        running = bool(me.in_flight[k]) or requests > 0
        queue_ms, iterations = chunked_ms(self.queued_by(i, k, now, others) + new * (1 + hidden))
        own_ms, own_iterations = chunked_ms(new)
        per_iteration, wait = running_streams_ms(usage, running)
        value = self.w * queue_ms + iterations * per_iteration + wait
        value += self.work * tokens_ms(own_ms, own_iterations)
        tie = len(me.in_flight[k]) + (requests if self.share == "bookings" else 0)
        return value, tie, new, own_ms + own_iterations * per_iteration

    def choose(self, i, request, now):
        """Replica `i`'s choice for `request`: (engine, new tokens, own ms, every engine's
        (value, new tokens))."""
        me = self.replicas[i]
        while me.read < len(self.log) and self.log[me.read][0] + self.delay <= now:
            at, j, k, hashes = self.log[me.read]
            me.read += 1
            if j != i:
                for h in hashes:
                    me.decided[k][h] = at + self.delay + self.ttl
        best = None
        scored = []
        for k in range(len(self.engines)):
            value, tie, new, own_ms = self.replica_cost(i, k, request, now)
            scored.append((value, new, own_ms))
            key = (value, tie, random.random())
            if best is None or key < best[0]:
                best = (key, k, new, own_ms)
        _, k, new, own_ms = best
        if self.temperature > 0:
            k = draw([value for value, _, _ in scored], self.temperature)
            _, new, own_ms = scored[k]
        return k, new, own_ms, scored

    def decisive(self, i, request, now, k, scored):
        """Whether replica `i`'s choice `k` stands as kvmesh's `decisive` asks: `k` caches
        more than the next cheapest engine, and stays cheaper with a request like this one
        from every other replica queued there unseen."""
        if self.temperature > 0:
            return False
        rest = [(value, new) for e, (value, new, _) in enumerate(scored) if e != k]
        if not rest:
            return True
        next_value, next_new = min(rest)
        if scored[k][1] >= next_new:
            return False
        return self.replica_cost(i, k, request, now, hidden=self.count - 1)[0] < next_value

    def route(self, request, now):
        lane = self.reach(request)
        self.arrived += 1
        i = lane
        k, new, own_ms, scored = self.choose(i, request, now)
        if self.decide == "decisive" and self.count > 1 and not self.decisive(i, request, now, k, scored):
            # Asked: replica 0 decides and books it at once (kvmesh's decider books it until
            # the asker's share shows it), a round trip late.
            i = 0
            k, new, own_ms, _ = self.choose(i, request, now)
            request.extra = 2 * self.delay
        self.owner[request] = (i, self.arrived, lane)
        me = self.replicas[i]
        for h in request.hashes:
            me.decided[k][h] = now + self.ttl
            me.blocks[k][h] = me.blocks[k].get(h, 0) + 1
        self.log.append((now, i, k, request.hashes))
        me.prefill[k][request] = (new, own_ms, now, self.arrived)
        me.in_flight[k].add(request)
        self.publish(i, k, now)
        return k

    def first_token(self, request, now):
        i, _, _ = self.owner[request]
        me = self.replicas[i]
        if me.prefill[request.engine].pop(request, None) is not None:
            me.last_first[request.engine] = now
            self.publish(i, request.engine, now)

    def ended(self, engine, now):
        k = engine.index
        done = []
        for i, me in enumerate(self.replicas):
            ended = [r for r in me.in_flight[k] if r.done]
            if not ended:
                continue
            for r in ended:
                me.in_flight[k].discard(r)
                for h in r.hashes:
                    me.blocks[k][h] -= 1
                    if me.blocks[k][h] == 0:
                        del me.blocks[k][h]
                _, order, lane = self.owner.pop(r)
                done.append((order, lane))
            self.publish(i, k, now)
        for _, i in sorted(done):
            self.idle.append(i)


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


def load(path, limit, speedup, jitter_ms=0.0, seed=1):
    """The first `limit` requests of the trace at `path`, `speedup` times faster; each arrival
    moved later by up to `jitter_ms` (uniform, drawn from `seed`), to spread out the trace's
    bursts of requests with one timestamp."""
    requests = []
    jitter = random.Random(seed)
    with open(path) as f:
        for line in f:
            if len(requests) == limit:
                break
            d = json.loads(line)
            arrival = d["timestamp"] / speedup
            if jitter_ms:
                arrival += jitter.uniform(0.0, jitter_ms)
            requests.append(Request(arrival, d["input_length"],
                                    max(1, d["output_length"]), d["hash_ids"]))
    return requests


def measure(policy, args, seed):
    """Replays the trace slice through `policy`: TTFT p50, p90, p99, hit rate, requests per
    engine."""
    random.seed(seed)
    requests = load(args.trace, args.slice_requests, args.arrival_speedup,
                    getattr(args, "arrival_jitter_ms", 0.0), seed)
    engines = replay(policy, requests, args.engines)
    extra = getattr(policy, "extra_ms", 0.0)
    ttft = sorted(r.first - r.arrival + extra + r.extra for r in requests)
    q = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))]
    hits = sum(e.hit_tokens for e in engines) / max(1, sum(e.query_tokens for e in engines))
    per = [0] * args.engines
    for r in requests:
        per[r.engine] += 1
    return q(.5), q(.9), q(.99), hits, per


def kv_policy(args, replicas, **kwargs):
    """kvmesh's `kv` with `kwargs`, run by one proxy or by `replicas` of them."""
    if replicas == 1:
        return KvCost(**kwargs)
    return ReplicatedKv(replicas, args.share_delay_ms, args.spread, args.share, args.decide,
                        args.temperature, **kwargs)


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else (
        values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def replica_sweep(args):
    """kvmesh kv's defaults at each replica count of `--replica-sweep`: medians over
    `--seeds`, each against one replica's, within 5 % or not."""
    counts = [int(c) for c in args.replica_sweep.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {}
    for count in sorted(set(counts) | {1}):
        runs = [measure(kv_policy(args, count), args, seed)[:4] for seed in seeds]
        results[count] = runs
    base = [median([run[i] for run in results[1]]) for i in range(4)]
    spread = [(min(run[i] for run in results[1]), max(run[i] for run in results[1]))
              for i in range(4)]
    print(f"kvmesh kv defaults; share: {args.share}, delay {args.share_delay_ms:g} ms, "
          f"spread: {args.spread}, decide: {args.decide}, temperature {args.temperature:g}, "
          f"arrival jitter {args.arrival_jitter_ms:g} ms; medians of seeds {args.seeds}; one replica's range over "
          f"the seeds: TTFT p50 {spread[0][0]:.0f}–{spread[0][1]:.0f}, p90 "
          f"{spread[1][0]:.0f}–{spread[1][1]:.0f}, p99 {spread[2][0]:.0f}–{spread[2][1]:.0f}, "
          f"hit rate {spread[3][0]:.3f}–{spread[3][1]:.3f}")
    print()
    print("| replicas | TTFT p50 | TTFT p90 | TTFT p99 | hit rate | p50 / 1 | p90 / 1 | p99 / 1 "
          "| hit rate / 1 | within 5 % (p50, p90, reuse) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for count in counts:
        m = [median([run[i] for run in results[count]]) for i in range(4)]
        r = [m[i] / base[i] if base[i] else float("nan") for i in range(4)]
        ok = r[0] <= 1.05 and r[1] <= 1.05 and r[3] >= 0.95
        print(f"| {count} | {m[0]:.0f} | {m[1]:.0f} | {m[2]:.0f} | {m[3]:.3f} | {r[0]:.3f} "
              f"| {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} | {'pass' if ok else '**FAIL**'} |",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--slice-requests", type=int, default=2000)
    ap.add_argument("--arrival-speedup", type=float, default=4.0)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1,
                    help="proxy replicas running the kv rows (default 1: one proxy)")
    ap.add_argument("--share-delay-ms", type=float, default=1.0,
                    help="how late a replica's decisions and load reach the others (default 1: "
                         "they are shared at every change, over NATS)")
    ap.add_argument("--spread", choices=["lanes", "request"], default="lanes",
                    help="how requests reach replicas: lanes (kvmesh-bench's connections, "
                         "opened on each replica in turn, the last freed reused first; the "
                         "harness) or request (each request to the next replica)")
    ap.add_argument("--share", choices=["loads", "bookings"], default="loads",
                    help="what replicas share of their in-flight load: loads (per-instance "
                         "totals, what kvmesh does) or bookings (each request)")
    ap.add_argument("--decide", choices=["own", "leader", "decisive"], default="own",
                    help="who decides a replica's requests: own (itself), leader (one replica "
                         "decides for all, a round trip of --share-delay-ms added to each "
                         "request's time to first token) or decisive (kvmesh: a replica decides "
                         "alone when its choice is decisive, else the leader does, a round trip "
                         "later)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="kv.temperature of the replicas (default 0: the cheapest instance)")
    ap.add_argument("--arrival-jitter-ms", type=float, default=0.0,
                    help="move each arrival later by up to this many engine-time ms (uniform): "
                         "the trace's requests come in bursts with one timestamp")
    ap.add_argument("--replica-sweep", metavar="COUNTS",
                    help="comma-separated replica counts: instead of the policy table, kvmesh "
                         "kv's defaults at each, medians over --seeds, against one replica")
    ap.add_argument("--seeds", default="1,2,3", help="seeds of --replica-sweep (default 1,2,3)")
    args = ap.parse_args()
    if args.replica_sweep:
        replica_sweep(args)
        return
    kv = lambda **kwargs: kv_policy(args, args.replicas, **kwargs)
    policies = [RoundRobin(), CacheAware(), kv(decay=False), kv(),
                kv(overlap_weight=2.0), kv(work_weight=0.0), kv(work_weight=4.0)]
    print("| policy | TTFT p50 | TTFT p90 | TTFT p99 | hit rate | requests per engine |")
    print("|---|---:|---:|---:|---:|---:|")
    for policy in policies:
        p50, p90, p99, hits, per = measure(policy, args, args.seed)
        print(f"| {policy.name} | {p50:.0f} | {p90:.0f} | {p99:.0f} | {hits:.3f} "
              f"| {min(per)}–{max(per)} |", flush=True)


if __name__ == "__main__":
    main()
