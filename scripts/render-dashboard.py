#!/usr/bin/env python3
"""Draws docs/img/dashboard.png: every panel of deploy/grafana/kvmesh.json, its queries run by a
real Prometheus server (Debian's `prometheus`, installed by scripts/setup.sh) that scraped a
running kvmesh cluster (tests/python/observed_cluster.py: etcd, NATS, simulated engines with
their worker-agents, the proxy) under a few minutes of traffic. Grafana itself is not
installable here (no Debian, PyPI or npm package ships its server), so matplotlib draws each
panel's series as Grafana's time-series panel would.

    .venv/bin/pip install matplotlib==3.10.7
    cargo build --locked --workspace --bins
    KVMESH_BIN_DIR=$PWD/target/debug .venv/bin/python scripts/render-dashboard.py [--minutes 4]

Not part of scripts/test.sh: it takes minutes and needs matplotlib.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from observed_cluster import ObservedCluster, break_streams, drive, forge_gap, free_port, wait_until  # noqa: E402

DASHBOARD = ROOT / "deploy" / "grafana" / "kvmesh.json"
OUT = ROOT / "docs" / "img" / "dashboard.png"
SCRAPE_S = 2
# What Grafana's $__rate_interval is with a 2 s scrape interval, roughly: several scrapes.
RATE_INTERVAL = "20s"
# Lines drawn per panel at most.
MAX_LINES = 10


def prometheus(workdir, proxy_admin, agents):
    """A Prometheus server scraping the proxy (honor_labels: its per-engine series keep their
    `instance`, the engine's URL, as docs/operations.md says to) and the agents."""
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
        "scrape_configs:\n"
        f"  - job_name: kvmesh-proxy\n    honor_labels: true\n    static_configs:\n      - targets: ['{proxy_admin}']\n"
        f"  - job_name: kvmesh-agent\n    static_configs:\n      - targets: {json.dumps(agents)}\n"
    )
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=open(workdir / "prometheus.log", "wb"), stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return httpx.get(url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until("prometheus", ready, 30)
    return proc, url


def legend(template, metric):
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), template) or json.dumps(metric)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    try:
        import matplotlib
    except ImportError:
        sys.exit("matplotlib missing: .venv/bin/pip install matplotlib==3.10.7")
    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from datetime import datetime

    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    with tempfile.TemporaryDirectory(prefix="kvmesh-dashboard-") as tmp:
        workdir = Path(tmp)
        cluster = ObservedCluster(workdir, speedup=4)
        prom = None
        try:
            agents = [agent.listeners["agent"] for agent in cluster.agents.values()]
            prom, url = prometheus(workdir, cluster.proxy.listeners["admin"], agents)
            start = time.time()
            duration = args.minutes * 60
            stop = threading.Event()

            def load(worker):
                n = 0
                while not stop.is_set():
                    drive(cluster, worker * 100_000 + n)
                    n += 1

            workers = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(3)]
            for w in workers:
                w.start()
            time.sleep(duration * 0.4)  # traffic runs meanwhile; nothing to wait for but time
            break_streams(cluster)
            time.sleep(duration * 0.2)
            forge_gap(cluster)
            time.sleep(duration * 0.4)
            stop.set()
            for w in workers:
                w.join()
            time.sleep(3 * SCRAPE_S)  # the last scrapes
            end = time.time()
            results = []
            for panel in panels:
                series = []
                for target in panel["targets"]:
                    expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$model", ".*")
                    reply = httpx.get(url + "/api/v1/query_range", params={
                        "query": expr, "start": start, "end": end, "step": SCRAPE_S}, timeout=30).json()
                    if reply["status"] != "success":
                        raise RuntimeError(f"{panel['title']}: {expr}: {reply}")
                    for result in reply["data"]["result"]:
                        points = [(float(t), float(v)) for t, v in result["values"] if v not in ("NaN", "+Inf", "-Inf")]
                        if points:
                            series.append((legend(target.get("legendFormat", ""), result["metric"]), points))
                results.append((panel, series))
        finally:
            if prom is not None:
                prom.kill()
                prom.wait()
            cluster.stop()

    cols = 4
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 5.2, rows * 3.3))
    fig.suptitle(f"kvmesh dashboard (deploy/grafana/kvmesh.json): {args.minutes:g} minutes of "
                 "tests/python/observed_cluster.py's traffic, queried from Prometheus", fontsize=13)
    for ax, (panel, series) in zip(axes.flat, results):
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        ax.set_title(panel["title"], fontsize=10, loc="left")
        if len(series) > MAX_LINES:
            # Series the traffic left at zero (say, other models' prefill legs) make room.
            series = [s for s in series if any(v for _, v in s[1])] or series
        for name, points in series[:MAX_LINES]:
            xs = [datetime.fromtimestamp(t) for t, _ in points]
            ys = [v * 100 if unit == "percentunit" else v for _, v in points]
            ax.plot(xs, ys, linewidth=1, label=name[:48])
        ax.set_ylabel({"percentunit": "%", "reqps": "req/s", "ops": "per s", "d": "days", "s": "s"}.get(unit, ""),
                      fontsize=8)
        ax.xaxis.set_major_locator(mdates.MinuteLocator())
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=6, loc="upper left", framealpha=0.6)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=72)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
