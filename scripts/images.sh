#!/usr/bin/env bash
# Builds the container images of deploy/docker/*.Dockerfile from binaries already built
# (by default target/debug: what `cargo build --locked --workspace --bins` leaves), with no
# registry: the runtime base is made from Debian's packages and the Dockerfiles' runtime stage
# is built by podman.
#
# Usage:
#   scripts/images.sh [--bin-dir DIR] [--refresh]
#
#   --bin-dir DIR  where the binaries are (default target/debug; target/release after
#                  `cargo build --release --locked --workspace --bins`)
#   --refresh      rebuild the base from today's Debian packages (and so rerun the Dockerfiles'
#                  RUN steps on it) instead of reusing the caches below
#
# How:
# 1. The base, a stand-in for `debian:bookworm-slim` (the runtime stages' FROM), is made by
#    mmdebstrap (variant minbase, merged /usr, no docs, man pages or locales, as the slim
#    image) into a tarball under ${XDG_CACHE_HOME:-~/.cache}/kvmesh/images/, named by a hash of
#    everything that goes into it, and imported into podman's storage with the slim image's
#    PATH and CMD. Both survive the clone: a warm machine reuses them.
# 2. Each Dockerfile's last stage is built as it is written, with two changes: its FROM is that
#    base, and each `COPY --from=<build stage> /usr/local/bin/X ...` copies X from --bin-dir
#    (the file the rust build stage would have installed there). RUN, USER, EXPOSE,
#    ENTRYPOINT and CMD are the Dockerfile's own, so the images cannot drift from it. RUN
#    steps (apt-get) reach Debian's mirror; podman caches their layers.
# 3. The image is tagged localhost/kvmesh/<binary>:<workspace version> in podman's storage
#    (push it with `podman push TAG docker://REGISTRY/...`) and saved as an OCI archive,
#    target/images/<binary>-<version>.oci.tar.
#
# Needs root (mmdebstrap --mode=root), mmdebstrap and podman (scripts/setup.sh installs them).
# Prints one line per image: `IMAGE <tag> <archive>`.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"

bin_dir="$repo/target/debug"
refresh=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) bin_dir="$(cd "$2" && pwd)"; shift 2 ;;
    --refresh) refresh=1; shift ;;
    *) echo "images.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

[ "$(id -u)" = 0 ] || { echo "images.sh: run as root (mmdebstrap --mode=root, podman's system storage)" >&2; exit 1; }

out="$repo/target/images"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/images"
mkdir -p "$out" "$cache"
# What mmdebstrap and podman say goes here; on a failure its tail is printed.
log="$out/build.log"
: >"$log"
quietly() {
  "$@" >>"$log" 2>&1 || {
    echo "images.sh: failed: $*" >&2
    tail -n 40 "$log" >&2
    exit 1
  }
}
version="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)"
[ -n "$version" ] || { echo "images.sh: no [workspace.package] version in Cargo.toml" >&2; exit 1; }

# The only base the runtime stages use; anything else is refused below.
SLIM=debian:bookworm-slim
SUITE=bookworm
mirror="${KVMESH_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${KVMESH_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
mmdebstrap_args=(
  --mode=root --variant=minbase --format=tar
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/groff/*'
  --dpkgopt='path-exclude=/usr/share/lintian/*' --dpkgopt='path-exclude=/usr/share/linda/*'
  --customize-hook='upload deploy/docker/base/apt-slim.conf /etc/apt/apt.conf.d/90kvmesh-slim'
  # With that config in place mmdebstrap's own clean-up no longer finds apt's caches.
  --customize-hook='rm -f "$1"/var/cache/apt/*.bin'
)
sources=(
  "deb $mirror $SUITE main"
  "deb $mirror $SUITE-updates main"
  "deb $security $SUITE-security main"
)
# What the slim image's config sets (the runtime stages inherit it).
slim_changes=(
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
  --change 'CMD ["bash"]'
)
key="$(printf '%s\n' "$(mmdebstrap --version)" "$SUITE" "${mmdebstrap_args[@]}" "${sources[@]}" "${slim_changes[@]}" \
  "$(cat deploy/docker/base/apt-slim.conf)" \
  | sha256sum | cut -c1-16)"
base_tar="$cache/$SUITE-slim-$key.tar"
base_image="localhost/kvmesh-base/debian:$SUITE-slim-$key"

# Images to remove once the images below no longer stand on them: bases of other keys, and
# this key's previous base when it is made again.
stale=()
for other in $(podman images --format '{{.Repository}}:{{.Tag}}' localhost/kvmesh-base/debian); do
  [ "$other" = "$base_image" ] || stale+=("$other")
done
imported="$(podman images -q --no-trunc "$base_image")"
if [ "$refresh" = 1 ] || [ ! -s "$base_tar" ]; then
  echo "images.sh: building the $SLIM stand-in with mmdebstrap ($base_tar)" >&2
  quietly mmdebstrap "${mmdebstrap_args[@]}" "$SUITE" "$base_tar.tmp" "${sources[@]}"
  mv "$base_tar.tmp" "$base_tar"
  find "$cache" -maxdepth 1 -name "$SUITE-slim-*.tar*" ! -path "$base_tar" -delete
  if [ -n "$imported" ]; then
    stale+=("$imported")
    imported=""
  fi
fi
if [ -z "$imported" ]; then
  quietly podman import "${slim_changes[@]}" "$base_tar" "$base_image"
fi

# Chroot isolation runs the RUN steps without an OCI runtime: crun cannot run where cgroup v1
# and v2 controllers are mixed, as on some CI VMs.
build_args=(--pull=never --network=host --isolation=chroot)

for dockerfile in deploy/docker/*.Dockerfile; do
  # The last stage, from its FROM line on.
  start="$(grep -n '^FROM ' "$dockerfile" | tail -1 | cut -d: -f1)"
  stage="$(tail -n +"$start" "$dockerfile")"
  from="$(head -1 <<<"$stage" | awk '{print $2}')"
  if [ "$from" != "$SLIM" ]; then
    echo "images.sh: $dockerfile: the runtime stage is FROM $from; only $SLIM can be made here" >&2
    exit 1
  fi
  # The binaries the stage copies from the build stage: `COPY --from=S /usr/local/bin/X DEST`.
  binaries="$(awk '$1 == "COPY" && $2 ~ /^--from=/ { n = split($3, p, "/"); print p[n] }' <<<"$stage")"
  if [ -z "$binaries" ] || grep -E '^COPY ' <<<"$stage" | grep -qvE '^COPY --from=[^ ]+ /usr/local/bin/[^ /]+ [^ ]+$'; then
    echo "images.sh: $dockerfile: every COPY of the runtime stage must be COPY --from=<stage> /usr/local/bin/<binary> <dest>" >&2
    exit 1
  fi
  name="$(head -1 <<<"$binaries")"
  context="$out/context/$name"
  rm -rf "$context"
  mkdir -p "$context"
  for b in $binaries; do
    [ -x "$bin_dir/$b" ] || { echo "images.sh: $bin_dir/$b missing (cargo build --locked --workspace --bins)" >&2; exit 1; }
    cp "$bin_dir/$b" "$context/$b"
  done
  awk -v base="$base_image" '
    NR == 1 { $2 = base; print; next }
    $1 == "COPY" && $2 ~ /^--from=/ { n = split($3, p, "/"); $2 = ""; $3 = p[n]; $0 = $0; $1 = $1; print; next }
    { print }
  ' <<<"$stage" >"$context/Containerfile"

  tag="localhost/kvmesh/$name:$version"
  old="$(podman images -q --no-trunc "$tag")"
  quietly podman build "${build_args[@]}" -f "$context/Containerfile" -t "$tag" "$context"
  new="$(podman images -q --no-trunc "$tag")"
  # The image this tag named before (older binaries) is garbage now, with its layers.
  if [ -n "$old" ] && [ "$old" != "$new" ]; then
    podman rmi "$old" >>"$log" 2>&1 || echo "images.sh: kept the previous $tag ($old): podman rmi failed, see $log" >&2
  fi
  # Saved again only when the image changed: compressing its layers is most of a warm run.
  archive="$out/$name-$version.oci.tar"
  if [ ! -s "$archive" ] || [ "$(cat "$archive.id" 2>/dev/null)" != "$new" ]; then
    rm -f "$archive" "$archive.id"
    quietly podman save --format oci-archive -o "$archive" "$tag"
    echo "$new" >"$archive.id"
  fi
  echo "IMAGE $tag $archive"
done

for image in "${stale[@]}"; do
  # --ignore: podman removes a base with the last image on it.
  podman rmi --ignore "$image" >>"$log" 2>&1 || echo "images.sh: kept the stale base $image: podman rmi failed, see $log" >&2
done
