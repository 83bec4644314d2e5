"""The container images of deploy/docker, built by scripts/images.sh from the binaries in
KVMESH_BIN_DIR (default target/debug) and run.

Each image's config (read from its OCI archive under target/images, the same image as podman's
tag) must carry the Dockerfile's runtime-stage ENTRYPOINT, CMD, USER and EXPOSE, expose every
port a Kubernetes manifest gives a container of that image, and hold the very binary of
KVMESH_BIN_DIR; then each binary is run inside its image with podman (as the image's user, from
its entrypoint) with `--version` and `--help`. A binary that needs a library the base lacks, a
user the image does not create, or a file the Dockerfile's RUN step should have installed fails
here.
"""

import hashlib
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("KVMESH_BIN_DIR", ROOT / "target" / "debug"))
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
# podman's default OCI runtime (crun) refuses hosts whose cgroup v1 and v2 controllers are
# mixed (this CI's VMs); runc runs there. Podman would also raise the container's open-file and
# process limits to its defaults, which root without CAP_SYS_RESOURCE (these VMs) may not:
# a `--version` run needs neither.
PODMAN_RUN = [
    "podman", "--runtime", "runc", "run", "--rm", "--pull=never", "--network=none",
    "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
]


def workspace_version():
    text = (ROOT / "Cargo.toml").read_text()
    return re.search(r'^\[workspace\.package\]\n(?:.*\n)*?version = "([^"]+)"', text, re.M).group(1)


def runtime_stage(dockerfile):
    """The last stage's instructions: {"FROM": [...], "USER": [...], ...}, continuation lines joined."""
    text = dockerfile.read_text()
    stage = text[text.rindex("\nFROM ") + 1 :]
    lines = re.sub(r"\\\n", " ", stage).splitlines()
    out = {}
    for line in lines:
        if line.strip() and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.setdefault(word, []).append(rest.strip())
    return out


def expected(dockerfile):
    stage = runtime_stage(dockerfile)
    entrypoint = json.loads(stage["ENTRYPOINT"][-1])
    cmd = json.loads(stage["CMD"][-1]) if "CMD" in stage else None
    ports = {f"{p}/tcp" for line in stage.get("EXPOSE", []) for p in line.split()}
    return {
        "binary": Path(entrypoint[0]).name,
        "Entrypoint": entrypoint,
        "Cmd": cmd,
        "User": stage["USER"][-1],
        "ports": ports,
        "run": " ".join(stage.get("RUN", [])),
    }


def manifest_ports(binary):
    """containerPorts of every container in deploy/k8s whose image is kvmesh/<binary>."""
    ports = set()
    for path in (ROOT / "deploy" / "k8s").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            stack = [doc]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    if str(node.get("image", "")).startswith(f"kvmesh/{binary}:"):
                        ports |= {f"{p['containerPort']}/tcp" for p in node.get("ports", [])}
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
    return ports


class Archive:
    """An OCI image archive (podman save --format oci-archive): its one manifest, config, layers."""

    def __init__(self, path):
        self.tar = tarfile.open(path)
        index = self.json("index.json")
        assert len(index["manifests"]) == 1, index
        self.manifest = self.blob_json(index["manifests"][0]["digest"])
        self.config_digest = self.manifest["config"]["digest"]
        self.config = self.blob_json(self.config_digest)

    def json(self, name):
        return json.load(self.tar.extractfile(name))

    def blob(self, digest):
        algo, _, hexdigest = digest.partition(":")
        return self.tar.extractfile(f"blobs/{algo}/{hexdigest}")

    def blob_json(self, digest):
        return json.load(self.blob(digest))

    def file_sha256(self, path):
        """sha256 of the regular file `path` in the image's filesystem (the last layer that has it)."""
        for layer in reversed(self.manifest["layers"]):
            with tarfile.open(fileobj=self.blob(layer["digest"]), mode="r|*") as t:
                for member in t:
                    if member.name.lstrip("./") == path.lstrip("/"):
                        assert member.isfile(), member
                        return hashlib.sha256(t.extractfile(member).read()).hexdigest()
        return None


@pytest.fixture(scope="module")
def built():
    """scripts/images.sh's `IMAGE <tag> <archive>` lines, by binary."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "images.sh"), "--bin-dir", str(BIN_DIR)],
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr
    images = {}
    for line in done.stdout.splitlines():
        word, tag, archive = line.split()
        assert word == "IMAGE", line
        images[tag.rpartition("/")[2].partition(":")[0]] = (tag, Path(archive))
    return images


def test_every_dockerfile_is_built(built):
    version = workspace_version()
    names = {expected(d)["binary"] for d in DOCKERFILES}
    assert names == {"kvmesh-proxy", "kvmesh-agent", "kvmesh-engine-sim"}
    assert set(built) == names
    for name, (tag, archive) in built.items():
        assert tag == f"localhost/kvmesh/{name}:{version}"
        assert archive == ROOT / "target" / "images" / f"{name}-{version}.oci.tar"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_config_is_the_dockerfiles(built, dockerfile):
    want = expected(dockerfile)
    name = want["binary"]
    tag, path = built[name]
    archive = Archive(path)
    config = archive.config["config"]
    assert config["Entrypoint"] == want["Entrypoint"] == [f"/usr/local/bin/{name}"]
    # No CMD in the Dockerfile: the base's (bash) is reset by ENTRYPOINT, as docker does.
    assert config.get("Cmd") == want["Cmd"]
    assert config["User"] == want["User"] == "10001:10001"
    assert set(config["ExposedPorts"]) == want["ports"]
    assert manifest_ports(name) <= want["ports"], f"{dockerfile.name}: EXPOSE misses a port the manifests use"
    # The archive is the image podman holds under the tag.
    image_id = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    assert f"sha256:{image_id}" == archive.config_digest
    # The base, the Dockerfile's RUN step and the binary: one layer each.
    assert len(archive.manifest["layers"]) == 2 + bool(want["run"])
    binary = hashlib.sha256((BIN_DIR / name).read_bytes()).hexdigest()
    assert archive.file_sha256(f"/usr/local/bin/{name}") == binary, "the image holds the binary of KVMESH_BIN_DIR"


def podman_run(tag, *args, entrypoint=None):
    cmd = PODMAN_RUN + (["--entrypoint", entrypoint] if entrypoint else []) + [tag, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_binary_runs_in_its_image(built, dockerfile):
    want = expected(dockerfile)
    name = want["binary"]
    tag, _ = built[name]
    version = podman_run(tag, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout == f"{name} {workspace_version()}\n"
    helped = podman_run(tag, "--help")
    assert helped.returncode == 0, helped.stderr
    assert f"Usage: {name} [OPTIONS]" in helped.stdout
    assert "--help" in helped.stdout and "--version" in helped.stdout
    ident = podman_run(tag, entrypoint="id")
    assert ident.returncode == 0, ident.stderr
    assert ident.stdout == "uid=10001(kvmesh) gid=10001(kvmesh) groups=10001(kvmesh)\n"
    # Where the Dockerfile installs ca-certificates (the proxy, the agent: without a CA file they
    # check TLS peers against the system's roots), the image has the bundle; elsewhere not.
    bundle = podman_run(tag, "-s", "/etc/ssl/certs/ca-certificates.crt", entrypoint="test")
    assert (bundle.returncode == 0) == ("ca-certificates" in want["run"]), bundle.stderr
