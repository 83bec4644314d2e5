"""The proxy checks its KV index against what the real engine says it had cached
(`kv.cache_check`, docs/configuration.md "The index checks itself"). Runs after
test_real_vllm.py: it replaces an agent, after which the suite's `events_settled` (agents'
published events against the proxy's applied ones) no longer balances.

KV events lost between an engine and its agent leave the index stale without any sequence
gap the proxy could see: the engine's own `cached_tokens` shows it, the instance is untrusted
and resynced, and once the agent sees the gap in the engine's numbers and replays what it
missed, the index agrees with the engine again.

KV events lost between the agent and NATS (a partition the agent's client cannot see) leave a
gap in the agent's own sequence numbers, which its load reports show the proxy once they flow
again.
"""

import random
import re
import signal
import subprocess
import sys
from pathlib import Path

from conftest import BLOCK_SIZE, ROOT, free_port, metric_sum, metrics, wait_until
from test_real_vllm import agent_blocks_published, chat, direct_chat, reported_on, text

HERE = Path(__file__).parent


class Relay:
    """A relay process the test cuts (SIGUSR1) and restores (SIGUSR2): tests/real_engines/
    zmq_relay.py between an engine's KV event publisher and its agent (`Relay.zmq`), or
    tcp_relay.py between an agent and nats-server (`Relay.tcp`)."""

    def __init__(self, argv, log_path, endpoint):
        self.endpoint = endpoint
        self.log_path = log_path
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._await_line("ready")

    @classmethod
    def zmq(cls, engine, workdir):
        """Between `engine`'s KV event publisher and its agent (the vLLM install's Python has
        pyzmq)."""
        python = subprocess.run(
            [str(ROOT / "scripts" / "vllm.sh"), "python"], check=True, capture_output=True, text=True
        ).stdout.strip().splitlines()[-1]
        port = free_port()
        return cls([python, str(HERE / "zmq_relay.py"), engine.events, str(port)],
                   workdir / "zmq-relay.log", f"tcp://127.0.0.1:{port}")

    @classmethod
    def tcp(cls, nats_url, workdir):
        """Between an agent and the NATS server at `nats_url`."""
        port = free_port()
        upstream = nats_url.removeprefix("nats://")
        return cls([sys.executable, str(HERE / "tcp_relay.py"), upstream, str(port)],
                   workdir / "tcp-relay.log", f"nats://127.0.0.1:{port}")

    def lines(self):
        return self.log_path.read_text(errors="replace").splitlines()

    def _await_line(self, line):
        def seen():
            if self.proc.poll() is not None:
                raise AssertionError(f"relay exited: {self.log_path.read_text(errors='replace')}")
            return line in self.lines()

        wait_until(f"the relay to say {line!r}", seen, timeout=30)

    def dropped(self):
        counts = [int(m.group(1)) for m in map(re.compile(r"dropped (\d+)").fullmatch, self.lines()) if m]
        return max(counts, default=0)

    def cut(self):
        self.proc.send_signal(signal.SIGUSR1)
        self._await_line("cut")

    def restore(self):
        self.proc.send_signal(signal.SIGUSR2)
        self._await_line("restored")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


def check_counters(cluster, engine):
    page = metrics(cluster.admin + "/metrics")
    answers = {
        result: metric_sum(page, "kvmesh_route_cache_check_answers_total", result=result)
        for result in ("agreed", "disagreed")
    }
    answers["mismatches"] = metric_sum(
        page, "kvmesh_route_cache_check_mismatches_total", instance=engine.url + "/"
    ) + metric_sum(page, "kvmesh_route_cache_check_mismatches_total", instance=engine.url)
    answers["resyncs"] = metric_sum(page, "kvmesh_kv_resyncs_total", reason="cache_check")
    return answers


def test_events_lost_between_engine_and_agent_are_caught_by_cached_tokens_and_repaired(cluster):
    engine = cluster.engines[1]
    relay = Relay.zmq(engine, cluster.workdir)
    try:
        cluster.stop_agent(engine)
        cluster.start_agent(engine, events=relay.endpoint)
        cluster.wait_instances(2)
        rng = random.Random(53)
        # Three prefixes the index learns on engine b while its events flow.
        prefixes = [[{"role": "system", "content": text(rng, 300)}] for _ in range(3)]
        for prefix in prefixes:
            usage = direct_chat(engine, prefix)
            blocks = usage["prompt_tokens"] // BLOCK_SIZE
            wait_until("the prefix in the index", lambda p=prefix, b=blocks: reported_on(cluster, engine, p) == b)
        relay.cut()
        before = check_counters(cluster, engine)
        # Fresh prompts fill b's 160-block cache and evict the prefixes; neither the stores
        # nor the removals reach the agent, so the index still says b holds the prefixes.
        flood = [[{"role": "user", "content": text(rng, 900)}] for _ in range(6)]
        stored = sum(direct_chat(engine, messages)["prompt_tokens"] // BLOCK_SIZE for messages in flood)
        assert stored > 160, stored
        wait_until("the relay to drop the flood's events", lambda: relay.dropped() >= len(flood))
        for prefix in prefixes:
            messages = prefix + [{"role": "user", "content": text(rng, 20)}]
            route, usage, _ = chat(cluster, messages)
            assert route["instance"].rstrip("/") == engine.url, route
            reported = int(route["reported_blocks"])
            cached = usage.prompt_tokens_details.cached_tokens // BLOCK_SIZE
            assert reported > cached, (route, usage)
        # Three disagreements of the last eight: b is untrusted and resynced.
        after = wait_until(
            "the check to untrust and resync b",
            lambda: (lambda c: c["resyncs"] > before["resyncs"] and c)(check_counters(cluster, engine)),
        )
        assert after["disagreed"] - before["disagreed"] >= 3, (before, after)
        assert after["mismatches"] - before["mismatches"] >= 3, (before, after)
        # The relay passes events again: b's next batch shows the agent the gap, it replays
        # what it missed from the engine, and the index holds what b holds.
        relay.restore()
        # (A prompt with fresh full blocks: a step that stores nothing publishes no batch.)
        direct_chat(engine, [{"role": "user", "content": text(rng, 60)}])
        last = flood[-1]
        last_blocks = direct_chat(engine, last)["prompt_tokens"] // BLOCK_SIZE
        wait_until("the repaired index", lambda: reported_on(cluster, engine, last) == last_blocks, timeout=60)
        agent = cluster.agents[engine.name]
        page = metrics(agent.url("agent") + "/metrics")
        assert metric_sum(page, "kvmesh_agent_engine_seq_gaps_total") >= 1
        agreed_before = check_counters(cluster, engine)["agreed"]
        route, usage, _ = chat(cluster, last + [{"role": "user", "content": text(rng, 20)}])
        assert route["instance"].rstrip("/") == engine.url, route
        assert int(route["reported_blocks"]) == usage.prompt_tokens_details.cached_tokens // BLOCK_SIZE
        wait_until(
            "the answer judged in agreement",
            lambda: check_counters(cluster, engine)["agreed"] == agreed_before + 1,
        )
    finally:
        # The rest of the suite runs against b's agent reading the engine directly.
        if engine.name in cluster.agents:
            cluster.stop_agent(engine)
        cluster.start_agent(engine)
        cluster.wait_instances(2)
        relay.stop()


def test_events_lost_between_agent_and_nats_show_as_a_sequence_gap_and_are_repaired(cluster):
    """A partition between engine b's agent and the bus that its NATS client cannot see: every
    byte it sends is dropped while the connection stays open. The agent publishes what b
    stores; the proxy applies none of it. When the partition ends (the connection is closed,
    the client reconnects), the agent's load reports carry the last batch number it issued,
    past the last one the proxy applied: the gap is resynced with no further batch, and the
    index holds what b stored meanwhile."""
    engine = cluster.engines[1]
    relay = Relay.tcp(cluster.nats.url, cluster.workdir)
    try:
        cluster.stop_agent(engine)
        cluster.start_agent(engine, nats=relay.endpoint)
        cluster.wait_instances(2)
        rng = random.Random(59)
        flowing = [{"role": "user", "content": text(rng, 200)}]
        blocks = direct_chat(engine, flowing)["prompt_tokens"] // BLOCK_SIZE
        wait_until("a prompt's blocks through the relay", lambda: reported_on(cluster, engine, flowing) == blocks)
        relay.cut()
        gaps_before = metric_sum(metrics(cluster.admin + "/metrics"), "kvmesh_kv_resyncs_total", reason="gap")
        published_before = agent_blocks_published(cluster, engine)
        missed = [[{"role": "user", "content": text(rng, 200)}] for _ in range(3)]
        missed_blocks = [direct_chat(engine, m)["prompt_tokens"] // BLOCK_SIZE for m in missed]
        # The agent published every one of those blocks, into the partition.
        wait_until("the agent to publish the missed blocks", lambda: agent_blocks_published(cluster, engine)
                   >= published_before + sum(missed_blocks))
        wait_until("the relay to drop the agent's batches", lambda: relay.dropped() > 0)
        assert [reported_on(cluster, engine, m) for m in missed] == [0, 0, 0]
        relay.restore()
        # No further batch: the agent's load reports say how far its numbering went.
        wait_until("the repaired index", lambda: [reported_on(cluster, engine, m) for m in missed]
                   == missed_blocks, timeout=60)
        gaps = metric_sum(metrics(cluster.admin + "/metrics"), "kvmesh_kv_resyncs_total", reason="gap")
        assert gaps > gaps_before, (gaps_before, gaps)
    finally:
        if engine.name in cluster.agents:
            cluster.stop_agent(engine)
        cluster.start_agent(engine)
        cluster.wait_instances(2)
        relay.stop()
