"""benches/aiperf_report.py turns what NVIDIA AIPerf 0.13.0 wrote (benches/data/aiperf-0.13.0:
its summary and the first records of a real run) and kvmesh-engine-cache's counters into the
report shape the routing-quality harness reads."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "benches" / "data" / "aiperf-0.13.0"


def test_the_report_carries_aiperfs_quantiles_the_records_cdf_and_the_engine_counters(tmp_path):
    cache = {"hit_rate": 0.5, "requests_min": 3, "requests_max": 21, "preemptions": 0,
             "oracle": None, "fraction_of_oracle": None}
    (tmp_path / "cache.json").write_text(json.dumps(cache))
    out = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benches" / "aiperf_report.py"), "--artifacts", str(ARTIFACTS),
         "--cache", str(tmp_path / "cache.json"), "--out", str(out)],
        check=True,
    )
    report = json.loads(out.read_text())
    summary = json.loads((ARTIFACTS / "profile_export_aiperf.json").read_text())
    assert report["aiperf_version"] == "0.13.0"
    assert report["requests_ok"] == 24
    assert report["errors_total"] == 0
    for ours, theirs in [("ttft_ms", "time_to_first_token"), ("itl_ms", "inter_token_latency"),
                         ("e2e_ms", "request_latency")]:
        for q in ("p50", "p90", "p99"):
            assert report[ours][q] == summary[theirs][q]
    assert report["requests_per_s"] == summary["request_throughput"]["avg"]
    assert report["output_tokens_per_s"] == summary["output_token_throughput"]["avg"]
    assert report["cache"] == cache

    records = [json.loads(line)["metrics"]["time_to_first_token"]["value"]
               for line in (ARTIFACTS / "profile_export.jsonl").read_text().splitlines()]
    cdf = report["ttft_cdf_ms"]
    assert len(cdf) == 100
    assert [q for q, _ in cdf] == [i / 100 for i in range(1, 101)]
    values = [ms for _, ms in cdf]
    assert values == sorted(values)
    assert set(values) == set(records)
    assert values[0] == min(records) and values[-1] == max(records)
    # Nearest rank: the median of six is the third smallest.
    assert dict(cdf)[0.5] == sorted(records)[2]
