"""deploy/prometheus/kvmesh-rules.yaml under Prometheus's own tool (Debian's `prometheus`
package, installed by scripts/setup.sh): `promtool check rules` parses every rule, and
`promtool test rules` runs kvmesh-rules.test.yaml, series that fire each alert and series
beside them that must not. That the expressions name only exported metrics and labels is
checked against a live cluster in test_dashboard.py."""

import shutil
import subprocess

import yaml

from kvmesh_processes import ROOT

RULES_DIR = ROOT / "deploy" / "prometheus"
# The alerts issue 33 asks for, and the lag histogram's.
ALERTS = {
    "KvmeshKvEventIntakeStalled", "KvmeshKvEventLagHigh", "KvmeshKvEventGapResyncsRepeating",
    "KvmeshAllInstancesBusy", "KvmeshErrorRatioHigh", "KvmeshMigrationFailures", "KvmeshAgentEngineNotReady",
    "KvmeshTlsCertificateExpiresSoon",
}


def promtool(*args):
    binary = shutil.which("promtool")
    assert binary, "promtool missing: scripts/setup.sh installs Debian's prometheus package"
    return subprocess.run([binary, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", "kvmesh-rules.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout, result.stdout


def test_every_alert_fires_on_its_series_and_not_beside_them():
    tests = yaml.safe_load((RULES_DIR / "kvmesh-rules.test.yaml").read_text())
    tested = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"]}
    fired = {
        case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]
    }
    rules = yaml.safe_load((RULES_DIR / "kvmesh-rules.yaml").read_text())
    assert {r["alert"] for g in rules["groups"] for r in g["rules"]} == ALERTS
    assert tested == fired == ALERTS
    result = promtool("test", "rules", "kvmesh-rules.test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
