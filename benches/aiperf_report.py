"""A kvmesh-bench-shaped JSON report from an NVIDIA AIPerf run, for benches/routing-quality.sh.

Usage: python aiperf_report.py --artifacts DIR --cache CACHE.json --out REPORT.json

DIR is AIPerf's `--artifact-dir` (its `profile_export_aiperf.json` summary and the per-request
`profile_export.jsonl`); CACHE.json is what `kvmesh-engine-cache` wrote around the run. The
report has the fields the routing-quality tables and plots read: requests_ok, errors_total,
ttft_ms / itl_ms / e2e_ms quantiles (AIPerf's own, wall-clock ms), requests_per_s,
output_tokens_per_s, ttft_cdf_ms (100 points from the per-request records) and cache.
Standard library only.
"""
import argparse
import json
import math
from pathlib import Path


def quantiles(summary: dict, name: str, keys: tuple[str, ...]) -> dict:
    """AIPerf's quantiles of metric NAME, as {p50: ms, ...} (absent ones are left out)."""
    metric = summary.get(name) or {}
    return {k: metric[k] for k in keys if metric.get(k) is not None}


def ttft_cdf(records: Path) -> list[list[float]]:
    """[fraction, ms] at every 1 % of the requests' TTFTs (nearest rank)."""
    values = []
    with records.open(encoding="utf-8") as f:
        for line in f:
            metrics = json.loads(line).get("metrics") or {}
            ttft = metrics.get("time_to_first_token")
            if ttft is not None:
                values.append(float(ttft["value"]))
    values.sort()
    if not values:
        return []
    points = []
    for i in range(1, 101):
        q = i / 100
        rank = max(1, math.ceil(q * len(values)))
        points.append([q, values[rank - 1]])
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", required=True, type=Path, help="AIPerf's --artifact-dir")
    parser.add_argument("--cache", required=True, type=Path, help="kvmesh-engine-cache's JSON")
    parser.add_argument("--out", required=True, type=Path, help="report to write")
    args = parser.parse_args()
    summary = json.loads((args.artifacts / "profile_export_aiperf.json").read_text(encoding="utf-8"))
    errors = sum(int(e.get("count", 0)) for e in summary.get("error_summary") or [])
    config = summary.get("input_config") or {}
    report = {
        "source": "aiperf",
        "aiperf_version": summary.get("aiperf_version"),
        "workload": {"kind": "aiperf", "input_config": config},
        "requests_ok": int((summary.get("request_count") or {}).get("avg", 0)),
        "errors_total": errors,
        "ttft_ms": quantiles(summary, "time_to_first_token", ("p50", "p90", "p99")),
        "itl_ms": quantiles(summary, "inter_token_latency", ("p50", "p90", "p99")),
        "e2e_ms": quantiles(summary, "request_latency", ("p50", "p90", "p99")),
        "requests_per_s": (summary.get("request_throughput") or {}).get("avg"),
        "output_tokens_per_s": (summary.get("output_token_throughput") or {}).get("avg"),
        "mean_input_tokens": (summary.get("input_sequence_length") or {}).get("avg"),
        "ttft_cdf_ms": ttft_cdf(args.artifacts / "profile_export.jsonl"),
        "cache": json.loads(args.cache.read_text(encoding="utf-8")),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
