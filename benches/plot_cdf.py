"""TTFT CDF plot from kvmesh-bench JSON reports (their `ttft_cdf_ms` points).

Usage: python plot_cdf.py --out FILE.png [--title T] [--scale S] LABEL=REPORT.json ...

`--scale` multiplies every latency (wall ms -> engine-time ms when the sims ran S times faster).
Needs matplotlib; benches/routing-quality.sh runs it from its own virtualenv.
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--title", default="TTFT CDF")
    parser.add_argument("--scale", type=float, default=1.0, help="latency multiplier")
    parser.add_argument("series", nargs="+", help="LABEL=REPORT.json")
    args = parser.parse_args()

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for item in args.series:
        label, _, path = item.partition("=")
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        points = report.get("ttft_cdf_ms") or []
        if not points:
            continue
        xs = [max(ms * args.scale, 1e-3) for _, ms in points]
        ys = [q for q, _ in points]
        ax.plot(xs, ys, label=label, linewidth=1.6)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token, ms (engine time, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(args.title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out)


if __name__ == "__main__":
    main()
