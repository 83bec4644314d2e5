"""deploy/grafana/kvmesh.json and deploy/prometheus/kvmesh-rules.yaml against the metrics a
real cluster exports: the cluster of observed_cluster.py (etcd, NATS, simulated engines with
their agents, the proxy) after traffic that exercises every panel's series, scraped at the
proxy's and every agent's /metrics.

Fails when a panel the dashboard must have is missing, when a panel's query or an alert's
expression names a metric or a label that neither the proxy nor the agents export, or when a
series the traffic makes has no sample.
"""

import json
import time
import re

import pytest
import yaml

from observed_cluster import (
    CERT_DAYS, CHAT, FLAKY, PD, ObservedCluster, break_streams, certificate_not_after, drive, forge_gap, wait_until,
)
from kvmesh_processes import ROOT
from promql_names import Exposition, names, unknown_names

DASHBOARD = ROOT / "deploy" / "grafana" / "kvmesh.json"
RULES = ROOT / "deploy" / "prometheus" / "kvmesh-rules.yaml"

# The panels an operator looks at first (issue 33), by title.
REQUIRED_PANELS = [
    "Requests by model and status",
    "Errors by model",
    "Time to first token",
    "Inter-token latency",
    "End-to-end latency",
    "Tokens in and out",
    "Prefix reuse: predicted overlap",
    "Prefix reuse: engines' cached tokens",
    "Routing decisions and reasons",
    "Per-instance load",
    "Busy state",
    "Migrations",
    "Prefill legs",
    "KV events applied",
    "KV event gaps and resyncs",
    "KV event lag",
    "Agent health",
    "KV transfer pacing",
    "TLS certificate expiry",
]


def panels():
    dashboard = json.loads(DASHBOARD.read_text())
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exprs():
    """(where, expr) of every panel target and every alert."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in panels() for t in p["targets"]]
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        out += [(f"alert {r['alert']}", r["expr"]) for r in group["rules"]]
    return out


@pytest.fixture(scope="module")
def scraped(workdir):
    cluster = ObservedCluster(workdir / "dashboard")
    try:
        statuses = drive(cluster)
        assert statuses.count(200) == len(statuses) - 2 and statuses[-3:-1] == [404, 400], statuses
        migrated, failed, refused = break_streams(cluster)
        assert migrated[-1] == "[DONE]" and '"error"' not in "".join(migrated), migrated
        assert '"upstream_disconnected"' in failed[-1], failed
        # 502 while the health checks have not ejected the dead engines yet, then 503.
        assert refused in (502, 503), refused
        forge_gap(cluster)
        wait_until("the forged batch's gap", lambda: 'kvmesh_kv_event_gaps_total{model="chat-model"}' in cluster.proxy_metrics(), 10)
        # A round after the gap: the resynced instance is fed again.
        drive(cluster, 1)
        proxy = Exposition().add(cluster.proxy_metrics())
        agents = {name: Exposition().add(text) for name, text in cluster.agent_metrics().items()}
        union = Exposition()
        union.add(cluster.proxy_metrics())
        for text in cluster.agent_metrics().values():
            union.add(text)
        yield {"proxy": proxy, "agents": agents, "union": union, "cert": cluster.cert}
    finally:
        cluster.stop()


def test_the_promql_reader_finds_names_labels_and_groupings():
    found = names('sum by (le, model) (rate(kvmesh_x_bucket{model=~"$model", status!="5.."}[$__rate_interval]))'
                  ' / on () group_left sum(kvmesh_y) - time() > 0.5 and kvmesh_z')
    assert found.selectors == [("kvmesh_x_bucket", ["model", "status"]), ("kvmesh_y", []), ("kvmesh_z", [])]
    assert found.grouping == {"le", "model"}
    exported = Exposition().add(
        "# TYPE kvmesh_x histogram\n"
        'kvmesh_x_bucket{model="m",le="+Inf"} 1\n'
        "# TYPE kvmesh_y gauge\n"
    )
    assert unknown_names('sum by (le, model) (rate(kvmesh_x_bucket{model="m"}[5m]))', exported) == []
    assert unknown_names("kvmesh_y", exported) == []
    assert unknown_names('kvmesh_x_count{job="a"}', exported) == []
    assert unknown_names('sum by (reason) (kvmesh_x_sum{stage="x"})', exported) == [
        "kvmesh_x_sum has no label stage", "grouping label reason is on none of ['kvmesh_x_sum']"]
    assert unknown_names("rate(kvmesh_missing_total[5m])", exported) == ["metric kvmesh_missing_total is not exported"]


def test_every_required_panel_is_there_once_with_a_query():
    titles = [p["title"] for p in panels()]
    assert len(titles) == len(set(titles)), titles
    missing = [t for t in REQUIRED_PANELS if t not in titles]
    assert not missing, f"panels missing from {DASHBOARD}: {missing}"
    for panel in panels():
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_the_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]


def test_every_query_and_alert_names_only_exported_metrics_and_labels(scraped):
    union = scraped["union"]
    problems = [f"{where}: {problem}" for where, expr in exprs() for problem in unknown_names(expr, union)]
    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"]).groups()
            if label not in union.labels.get(metric, set()):
                problems.append(f"variable {variable['name']}: {metric} has no label {label}")
    assert not problems, "\n".join(problems)


def test_every_panels_metrics_have_samples_after_the_traffic(scraped):
    union = scraped["union"]
    empty = sorted({
        f"panel {p['title']!r}: {metric}"
        for p in panels() for t in p["targets"] for metric, _ in names(t["expr"]).selectors
        if not union.has_sample(metric)
    })
    assert not empty, "no samples for:\n" + "\n".join(empty)


def test_the_traffic_moved_each_panels_series(scraped):
    """The series the traffic makes are not only there but counted what it did."""
    proxy, agents = scraped["proxy"], scraped["agents"]
    positive = {
        "requests 200": proxy.value("kvmesh_requests_total", model=CHAT, status="200"),
        "requests 404": proxy.value("kvmesh_requests_total", status="404"),
        "requests 5xx": sum(v for n, labels, v in proxy.samples
                            if n == "kvmesh_requests_total" and labels["model"] == FLAKY and labels["status"][0] == "5"),
        "client errors": proxy.value("kvmesh_client_errors_total", reason="invalid_json"),
        "TTFT": proxy.value("kvmesh_time_to_first_token_seconds_count", model=CHAT),
        "ITL": proxy.value("kvmesh_inter_token_latency_seconds_count", model=CHAT),
        "tokens in": proxy.value("kvmesh_input_tokens_sum", model=CHAT),
        "tokens out": proxy.value("kvmesh_output_tokens_total", model=CHAT),
        "cached tokens": proxy.value("kvmesh_input_cached_tokens_total", model=CHAT),
        "overlap": proxy.value("kvmesh_route_overlap_blocks_sum", model=CHAT),
        "kv decisions": proxy.value("kvmesh_route_overlap_blocks_count", model=CHAT),
        "migrations": proxy.value("kvmesh_migrations_total", model=FLAKY),
        "migration failures": proxy.value("kvmesh_migration_failures_total", model=FLAKY),
        "upstream errors": proxy.value("kvmesh_upstream_errors_total", model=FLAKY),
        "remote prefill legs": proxy.value("kvmesh_prefill_legs_total", model=PD, outcome="remote"),
        "events applied": proxy.value("kvmesh_kv_events_applied_total", model=CHAT, status="ok"),
        "gaps": proxy.value("kvmesh_kv_event_gaps_total", model=CHAT),
        "gap resyncs": proxy.value("kvmesh_kv_resyncs_total", reason="gap"),
        "first-sight resyncs": proxy.value("kvmesh_kv_resyncs_total", reason="first_sight"),
        "event lag": proxy.value("kvmesh_kv_event_lag_seconds_count", model=CHAT),
        "healthy instances": proxy.value("kvmesh_instance_healthy", model=CHAT),
        "discovery connected": proxy.value("kvmesh_discovery_connected"),
        "events connected": proxy.value("kvmesh_events_connected"),
        # Routing chooses which chat engine caches what: the two agents together published.
        "agent batches": sum(agents[f"chat-{i}"].value("kvmesh_agent_batches_published_total") for i in range(2)),
        "agent engine healthy": agents["chat-0"].value("kvmesh_agent_engine_healthy"),
        "agent registered": agents["chat-0"].value("kvmesh_agent_registered"),
        "decode legs paced": agents["decode"].value("kvmesh_agent_kv_transfers_admitted_total"),
        "pacing waits": agents["decode"].value("kvmesh_agent_kv_transfer_wait_seconds_count"),
    }
    assert not [k for k, v in positive.items() if v <= 0], positive
    assert proxy.value("kvmesh_migration_failures_total", model=CHAT) == 0
    assert proxy.value("kvmesh_prefill_legs_total", model=PD, outcome="failed") == 0
    # The cached share is a share.
    assert positive["cached tokens"] < positive["tokens in"]


def test_the_certificate_expiry_is_the_listeners_not_after(scraped):
    expiry = scraped["proxy"].value("kvmesh_tls_certificate_expiry_timestamp_seconds", listener="secure")
    assert expiry == certificate_not_after(scraped["cert"])
    assert scraped["proxy"].labels["kvmesh_tls_certificate_expiry_timestamp_seconds"] == {"listener"}
    assert not scraped["proxy"].value("kvmesh_tls_certificate_expiry_timestamp_seconds", listener="main")
    assert CERT_DAYS - 1 < (expiry - time.time()) / 86400 <= CERT_DAYS
