#!/usr/bin/env bash
# Fuzzes kvmesh's parsers with cargo-fuzz (libFuzzer, AddressSanitizer): the targets of fuzz/
# (docs/fuzzing.md says what each one checks).
#
# Usage:
#   scripts/fuzz.sh [--time SECONDS] [TARGET...]   run each target for SECONDS (default 60)
#   scripts/fuzz.sh --budget SECONDS [TARGET...]   install, build and run within SECONDS in all:
#                                                  the runs share what the build leaves, at least
#                                                  MIN_RUN seconds each (scripts/test.sh: 300)
#   scripts/fuzz.sh --list                         the targets
# With no TARGET, every target, one after the other.
#
# KVMESH_FUZZ_HOME (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/fuzz) is outside the clone,
# so that a fresh clone on the same machine starts warm. It keeps cargo-fuzz (pinned, installed
# once: about 1.5 minutes), the instrumented build (target/: about 5 minutes cold on 2 cores,
# seconds when only kvmesh's crates changed) and each target's corpus as it grows
# (corpus/TARGET; the committed seeds of fuzz/seeds/TARGET are read beside it).
#
# cargo-fuzz builds with `-Zsanitizer=address`, a nightly flag: with the stable toolchain this
# machine has, RUSTC_BOOTSTRAP=1 lets rustc accept it. Only this script's cargo commands get it,
# and fuzz/ is a workspace of its own with its own target directory, so no other build does.
#
# A crash (a panic, a failed assertion, a sanitizer report, a timeout) ends the script with a
# failure: the input is in fuzz/artifacts/TARGET/, and cargo-fuzz prints how to rerun and
# minimise it. Fix it with a regression test in the crate whose parser failed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"

CARGO_FUZZ_VERSION=0.13.2
MIN_RUN=10
home="${KVMESH_FUZZ_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/fuzz}"
tools="$home/cargo-fuzz-$CARGO_FUZZ_VERSION"
export RUSTC_BOOTSTRAP=1

time_per_target=60 budget="" list=false targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time) time_per_target="$2"; shift 2 ;;
    --budget) budget="$2"; shift 2 ;;
    --list) list=true; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
started=$SECONDS

# cargo-fuzz is only the driver (it runs cargo and the fuzzer): a debug build installs in
# about half the time of a release one.
if [ ! -x "$tools/bin/cargo-fuzz" ]; then
  echo "fuzz.sh: installing cargo-fuzz $CARGO_FUZZ_VERSION into $tools (once per machine)" >&2
  cargo install --quiet --locked --debug --version "$CARGO_FUZZ_VERSION" --root "$tools" cargo-fuzz
fi
export PATH="$tools/bin:$PATH"

if $list; then
  cargo fuzz list
  exit 0
fi
named=("${targets[@]}")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)

# fuzz/Cargo.lock pins what the targets build, like the workspace's Cargo.lock (cargo-fuzz has
# no --locked of its own).
if ! cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null; then
  echo "fuzz.sh: fuzz/Cargo.lock is out of date. Refresh it from the workspace's lock file:" >&2
  echo "  cp Cargo.lock fuzz/Cargo.lock && cargo metadata --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null" >&2
  exit 1
fi

build=(--target-dir "$home/target")
if [ ${#named[@]} -eq 0 ]; then
  cargo fuzz build "${build[@]}"
else
  for target in "${named[@]}"; do
    cargo fuzz build "${build[@]}" "$target"
  done
fi

per_target=$time_per_target
if [ -n "$budget" ]; then
  left=$((budget - (SECONDS - started)))
  # About 2 s of each run go to cargo-fuzz starting it, 1 s to the fuzzer's last report.
  per_target=$((left / ${#targets[@]} - 3))
  [ "$per_target" -ge "$MIN_RUN" ] || per_target=$MIN_RUN
  echo "fuzz.sh: built in $((SECONDS - started)) s; ${per_target} s per target"
fi

mkdir -p "$home/logs"
for target in "${targets[@]}"; do
  mkdir -p "$home/corpus/$target"
  seeds=()
  [ -d "fuzz/seeds/$target" ] && seeds=("fuzz/seeds/$target")
  log="$home/logs/$target.log"
  # -timeout: an input that takes 10 s is a hang; -rss_limit_mb: one that needs 2 GB a leak.
  if ! cargo fuzz run "${build[@]}" "$target" "$home/corpus/$target" "${seeds[@]}" -- \
      -max_total_time="$per_target" -timeout=10 -rss_limit_mb=2048 >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz.sh: $target FAILED (whole log: $log; the input: fuzz/artifacts/$target/)" >&2
    exit 1
  fi
  runs=$(grep -o '^Done [0-9]* runs' "$log" | grep -o '[0-9]*' || echo "?")
  corpus=$(find "$home/corpus/$target" -type f | wc -l)
  echo "fuzz.sh: $target: $runs inputs in ${per_target} s, no failure; corpus $corpus inputs"
done
echo "fuzz.sh: ${#targets[@]} targets in $((SECONDS - started)) s"
