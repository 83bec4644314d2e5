"""deploy/: every Kubernetes manifest and Dockerfile, checked so they cannot rot.

The base's files (deploy/k8s/base) and the example beside them are parsed (PyYAML), and
each overlay is taken as the real `kubectl kustomize` renders it (test_manifests.py checks
that a cluster would accept them); they are cross-checked: selectors against pod labels,
Service and probe ports against named container ports, images against the
Dockerfiles and the workspace version, the proxy's ConfigMap against the real
`kvmesh-proxy --check-config`, its listener ports against the container ports, the
probe paths against a running proxy, the agent's arguments against the ZMQ
endpoints vLLM (or the simulator) is started with and against the etcd / NATS
Services, and every flag a kvmesh container is given against its binary's `--help`; the
overlays' changes (TLS and credentials, the InferencePool, prefill and decode workers) against
the base and the proxy's config.
"""

import functools
import json
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import BIN_DIR, ROOT, Proc
from k8s_manifests import render

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The base: `kubectl apply -k deploy/k8s/base`.
BASE = K8S / "base"
# Manifests applied beside the base with `kubectl apply -f`.
EXAMPLES = K8S / "examples"
# The overlay that locks the control plane down (TLS, credentials): patches of the base,
# checked below.
SECURE = K8S / "secure"
# The overlay behind an Inference Extension gateway: an InferencePool whose endpoint picker is
# the proxy (kinds from CRDs the base does not need), checked below.
INFERENCE = K8S / "inference-pool"
# The overlay with prefill and decode workers and a disaggregated model, checked below.
DISAGGREGATED = K8S / "disaggregated"
OVERLAYS = [SECURE, INFERENCE, DISAGGREGATED]
DOCKER = DEPLOY / "docker"
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
KNOWN_KINDS = WORKLOAD_KINDS | {
    "Namespace",
    "ConfigMap",
    "Service",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "Kustomization",
}
KVMESH_IMAGE = re.compile(r"^kvmesh/(kvmesh-[a-z-]+):(.+)$")
PROXY_CONFIG_KEY = "kvmesh.yaml"


def manifests():
    """[(path, document)] of every YAML document of the base and the examples."""
    out = []
    for path in sorted(BASE.glob("*.yaml")) + sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path, doc))
    return out


DOCS = manifests()


def objects(kind=None, docs=None):
    """The base's and the examples' documents (or `docs`), of `kind` if given."""
    docs = [doc for _, doc in DOCS] if docs is None else docs
    return [doc for doc in docs if kind is None or doc["kind"] == kind]


def find(kind, name, docs=None):
    found = [doc for doc in objects(kind, docs) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def stack(name):
    """The objects of a stack the tests below check alike: `files` (the base's and the
    examples' files) or an overlay as `kubectl kustomize` renders it (read-only)."""
    return objects() if name == "files" else list(render(K8S / name))


STACKS = ["files"] + [overlay.name for overlay in OVERLAYS]


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def containers(workload, init=False):
    spec = pod_spec(workload)
    return spec.get("containers", []) + (spec.get("initContainers", []) if init else [])


def container(workload, name):
    found = [c for c in containers(workload) if c["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']}: container {name}"
    return found[0]


def flags(args):
    """`--key=value` and `--key value` arguments as a dict (flags without value map to True)."""
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            if "=" in arg:
                key, value = arg[2:].split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                key, value = arg[2:], args[i + 1]
                i += 1
            else:
                key, value = arg[2:], True
            out[key] = value
        i += 1
    return out


def positional(args):
    """Arguments before the first flag."""
    out = []
    for arg in args:
        if arg.startswith("--"):
            break
        out.append(arg)
    return out


def port_of(url):
    return int(url.rsplit(":", 1)[1].split("/")[0])


def host_of(url):
    return url.split("://", 1)[1].rsplit(":", 1)[0]


def proxy_config(docs=None):
    return yaml.safe_load(find("ConfigMap", "kvmesh-proxy-config", docs)["data"][PROXY_CONFIG_KEY])


@functools.cache
def workspace_packages():
    out = subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    meta = json.loads(out)
    bins = {pkg["name"]: {t["name"] for t in pkg["targets"] if "bin" in t["kind"]} for pkg in meta["packages"]}
    version = next(pkg["version"] for pkg in meta["packages"] if pkg["name"] == "kvmesh-proxy")
    return bins, version


def help_text(binary):
    path = BIN_DIR / binary
    assert path.exists(), f"{path} missing: run `cargo build --workspace --bins` first"
    done = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=30)
    return done.stdout + done.stderr


def test_every_manifest_is_well_formed_and_listed():
    seen = set()
    for path, doc in DOCS:
        assert doc.get("apiVersion") and doc.get("kind") in KNOWN_KINDS, f"{path}: {doc.get('kind')}"
        if doc["kind"] == "Kustomization":
            continue
        name = doc["metadata"]["name"]
        assert (doc["kind"], name) not in seen, f"{path}: {doc['kind']}/{name} twice"
        seen.add((doc["kind"], name))
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvmesh", f"{path}: {name}"
    kustomization = objects("Kustomization")[0]
    listed = {BASE / r for r in kustomization["resources"]}
    top_level = {p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == top_level, f"kustomization.yaml resources differ: {sorted(map(str, listed ^ top_level))}"
    assert kustomization["namespace"] == find("Namespace", "kvmesh")["metadata"]["name"]


@pytest.mark.parametrize("name", STACKS)
def test_selectors_services_and_probes_point_at_real_pods_and_ports(name):
    docs = stack(name)
    workloads = objects("Deployment", docs) + objects("StatefulSet", docs)
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), w["metadata"]["name"]
        for c in containers(w):
            names = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in c:
                    port = c[probe]["httpGet"]["port"]
                    assert port in names, f"{w['metadata']['name']}/{c['name']} {probe} port {port}"
    for service in objects("Service", docs):
        selector = service["spec"]["selector"]
        matched = [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert matched, f"Service {service['metadata']['name']} selects no pods"
        for w in matched:
            names = {p["name"] for c in containers(w) for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names, f"Service {service['metadata']['name']}: {port['targetPort']}"
    for sts in objects("StatefulSet", docs):
        headless = find("Service", sts["spec"]["serviceName"], docs)
        assert headless["spec"]["clusterIP"] == "None"
    proxy = find("Deployment", "kvmesh-proxy", docs)
    pdb = find("PodDisruptionBudget", "kvmesh-proxy", docs)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= proxy["spec"]["template"]["metadata"]["labels"].items()
    assert pdb["spec"]["minAvailable"] < proxy["spec"]["replicas"]
    hpa = find("HorizontalPodAutoscaler", "kvmesh-proxy", docs)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "kvmesh-proxy")
    assert hpa["spec"]["minReplicas"] <= proxy["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    if any(m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"]):
        assert all("cpu" in c["resources"]["requests"] for c in containers(proxy))


@pytest.mark.parametrize("name", STACKS)
def test_variables_in_arguments_are_defined(name):
    docs = stack(name)
    for w in objects("Deployment", docs) + objects("StatefulSet", docs):
        for c in containers(w, init=True):
            defined = {e["name"] for e in c.get("env", [])}
            for arg in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\(([A-Z_]+)\)", arg):
                    assert var in defined, f"{w['metadata']['name']}/{c['name']}: $({var}) undefined"


@pytest.mark.parametrize("name", STACKS)
def test_images_are_pinned_and_kvmesh_images_are_built_here(name):
    docs = stack(name)
    _, version = workspace_packages()
    entrypoints = {}
    for dockerfile in DOCKER.glob("*.Dockerfile"):
        entry = re.search(r'^ENTRYPOINT \["/usr/local/bin/([^"]+)"\]', dockerfile.read_text(), re.M)
        assert entry, dockerfile
        entrypoints[entry.group(1)] = dockerfile
    assert set(entrypoints) == {"kvmesh-proxy", "kvmesh-agent", "kvmesh-engine-sim"}
    used = set()
    for w in objects("Deployment", docs) + objects("StatefulSet", docs):
        for c in containers(w, init=True):
            image = c["image"]
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, f"unpinned image {image}"
            match = KVMESH_IMAGE.match(image)
            if match:
                binary, tag = match.groups()
                assert tag == version, f"{image}: the workspace is {version}"
                assert binary in entrypoints, f"{image}: no Dockerfile builds {binary}"
                used.add(binary)
    if name == "files":
        assert used == set(entrypoints), f"images never deployed: {set(entrypoints) - used}"


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("*.Dockerfile")), ids=lambda p: p.name)
def test_dockerfile(dockerfile):
    bins, _ = workspace_packages()
    text = dockerfile.read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert len(stages) >= 2, "multi-stage"
    assert stages[-1][0] == "debian:bookworm-slim"
    build = re.search(r"cargo build --release --locked -p (\S+)", text)
    assert build, "cargo build --release --locked -p PKG"
    package = build.group(1)
    assert package in bins, f"{package} is not a workspace package"
    binary = re.search(r'^ENTRYPOINT \["/usr/local/bin/([^"]+)"\]', text, re.M).group(1)
    assert binary in bins[package], f"package {package} has no binary {binary}: {bins[package]}"
    assert f"target/release/{binary}" in text
    assert re.search(rf"^COPY --from={stages[0][1]} \S*{binary} /usr/local/bin/{binary}$", text, re.M)
    final = text[text.rindex("FROM ") :]
    user = re.search(r"^USER (\d+)(?::(\d+))?$", final, re.M)
    assert user and int(user.group(1)) != 0, "runs as a non-root user"
    ignore = Path(str(dockerfile) + ".dockerignore").read_text().split()
    assert "target/" in ignore


def test_proxy_config_passes_check_config():
    text = find("ConfigMap", "kvmesh-proxy-config")["data"][PROXY_CONFIG_KEY]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kvmesh.yaml"
        path.write_text(text)
        done = subprocess.run([str(BIN_DIR / "kvmesh-proxy"), "--check-config", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_proxy_ports_and_probes_match_its_config():
    config = proxy_config()
    proxy = find("Deployment", "kvmesh-proxy")
    c = container(proxy, "kvmesh-proxy")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    data = {port_of(l["address"]) for l in config["listeners"]}
    grpc = {port_of(config["grpc"]["address"])} if config.get("grpc", {}).get("address") else set()
    epp = {port_of(config["epp"]["address"])} if config.get("epp", {}).get("address") else set()
    admin = port_of(config["admin"]["address"])
    assert set(ports.values()) == data | grpc | epp | {admin}
    assert config["admin"]["address"].startswith("0.0.0.0:"), "probes reach the admin listener on the pod IP"
    assert ports[c["livenessProbe"]["httpGet"]["port"]] == admin
    assert ports[c["readinessProbe"]["httpGet"]["port"]] == admin
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    service = find("Service", "kvmesh-proxy")
    targets = {ports[p["targetPort"]] for p in service["spec"]["ports"]}
    assert targets == data | grpc | epp, "the Service exposes the data, gRPC and picker listeners, not admin"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert flags(c["args"])["config"] == f"{mount['mountPath']}/{PROXY_CONFIG_KEY}"
    grace = pod_spec(proxy)["terminationGracePeriodSeconds"]
    drain = int(config["shutdown"]["drain_timeout"].rstrip("s"))
    assert grace > drain + c["lifecycle"]["preStop"]["sleep"]["seconds"]
    for model in config["models"]:
        if model.get("tokenizer"):
            mounts = [m["mountPath"] for m in c["volumeMounts"]]
            assert model["tokenizer"] in mounts, "the tokenizer directory is mounted"


def test_probe_paths_exist_on_a_running_proxy(workdir):
    proxy = find("Deployment", "kvmesh-proxy")
    c = container(proxy, "kvmesh-proxy")
    cfg = workdir / "deploy-probes.yaml"
    cfg.write_text(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n"
        "models:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:9\n"
    )
    proc = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    try:
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            path = c[probe]["httpGet"]["path"]
            resp = httpx.get(proc.url("admin") + path)
            assert resp.status_code in (200, 503), f"{probe} {path}: {resp.status_code}"
            assert "status" in resp.json()
        assert httpx.get(proc.url("admin") + "/live").status_code == 200
    finally:
        proc.stop()


def check_agent(workload, engine, docs=None):
    """The agent of `workload` reads the KV events `engine` (its args) publishes and joins the
    same etcd / NATS / namespace / model as the proxy of `docs` (default: the base's); it
    registers the engine's pod address, or its own inbound sidecar's when it is one."""
    c = container(workload, "kvmesh-agent")
    agent = flags(c["args"])
    config = proxy_config(docs)
    assert agent["kv-events-endpoint"] == f"tcp://127.0.0.1:{engine['events_port']}"
    assert agent["kv-events-replay-endpoint"] == f"tcp://127.0.0.1:{engine['replay_port']}"
    assert agent["kv-events-topic"] == engine["topic"]
    assert agent["engine-url"] == f"http://127.0.0.1:{engine['port']}"
    registered = engine["port"]
    if "inbound-listen" in agent:
        # Every interface, so the proxies reach it; the sidecar port is the pod's way in.
        assert agent["inbound-listen"].startswith("0.0.0.0:"), agent["inbound-listen"]
        registered = port_of(agent["inbound-listen"])
        assert registered in {p["containerPort"] for p in c["ports"]} and registered != engine["port"]
    assert agent["advertise-url"] == f"http://$(POD_IP):{registered}", "the registered URL must be reachable from the proxy"
    assert agent["model"] == engine["model"]
    assert int(agent["block-size"]) == engine["block_size"]
    for duration in ("lease-ttl", "drain", "startup-timeout"):
        if duration in agent:
            assert re.fullmatch(r"\d+(ms|s|m)", agent[duration]), f"--{duration}={agent[duration]}"
    model = next(m for m in config["models"] if m["name"] == engine["model"])
    assert model["kv"]["block_size"] == engine["block_size"]
    assert agent["namespace"] == config["discovery"]["namespace"] == config["events"]["namespace"]
    assert config["discovery"]["kind"] == "etcd" and agent["etcd"] == config["discovery"]["endpoint"]
    assert config["events"]["kind"] == "nats" and agent["nats"] == config["events"]["url"]
    for url, service in ((agent["etcd"], "etcd"), (agent["nats"], "nats")):
        svc = find("Service", host_of(url), docs)
        assert svc["metadata"]["name"] == service
        assert port_of(url) in {p["port"] for p in svc["spec"]["ports"]}


def vllm_engine(worker):
    """What the vLLM container of `worker` serves and publishes (its model, ports, block size,
    KV event endpoints), checked to be a GPU engine publishing KV events."""
    vllm = container(worker, "vllm")
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert vllm["command"] == ["vllm", "serve"]
    args = vllm["args"]
    opts = flags(args)
    assert opts.get("enable-prefix-caching") is True, "KV events need prefix caching"
    events = json.loads(opts["kv-events-config"])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert events["endpoint"].startswith("tcp://*:") and events["replay_endpoint"].startswith("tcp://*:")
    ports = {p["containerPort"] for p in vllm["ports"]}
    engine = {
        "model": opts.get("served-model-name") or positional(args)[0],
        "port": int(opts["port"]),
        "block_size": int(opts["block-size"]),
        "events_port": port_of(events["endpoint"]),
        "replay_port": port_of(events["replay_endpoint"]),
        "topic": events.get("topic", ""),
    }
    assert {engine["port"], engine["events_port"], engine["replay_port"]} <= ports
    return engine


def test_gpu_worker_vllm_publishes_what_the_agent_reads():
    worker = find("Deployment", "kvmesh-worker")
    check_agent(worker, vllm_engine(worker))


def test_sim_worker_publishes_what_the_agent_reads():
    sim_worker = find("Deployment", "kvmesh-sim-worker")
    opts = flags(container(sim_worker, "engine-sim")["args"])
    engine = {
        "model": opts["model"],
        "port": int(opts["port"]),
        "block_size": int(opts["block-size"]),
        "events_port": port_of(opts["kv-events-endpoint"]),
        "replay_port": port_of(opts["kv-events-replay-endpoint"]),
        "topic": opts["kv-events-topic"],
    }
    assert opts["kv-events-endpoint"].startswith("tcp://127.0.0.1:")
    check_agent(sim_worker, engine)


@pytest.mark.parametrize("name", STACKS)
def test_every_flag_given_to_a_kvmesh_binary_exists(name):
    docs = stack(name)
    helps = {}
    for w in objects("Deployment", docs) + objects("StatefulSet", docs):
        for c in containers(w, init=True):
            match = KVMESH_IMAGE.match(c["image"])
            if not match:
                continue
            binary = match.group(1)
            text = helps.setdefault(binary, help_text(binary))
            for key in flags(c.get("args", [])):
                assert f"--{key}" in text, f"{w['metadata']['name']}/{c['name']}: {binary} has no --{key}"
    for dockerfile in DOCKER.glob("*.Dockerfile") if name == "files" else []:
        cmd = re.search(r"^CMD (\[.*\])$", dockerfile.read_text(), re.M)
        binary = re.search(r'ENTRYPOINT \["/usr/local/bin/([^"]+)"\]', dockerfile.read_text()).group(1)
        if cmd:
            text = helps.setdefault(binary, help_text(binary))
            for key in flags(json.loads(cmd.group(1))):
                assert f"--{key}" in text, f"{dockerfile.name}: {binary} has no --{key}"


def test_deploy_readme_commands_name_real_files():
    readme = (DEPLOY / "README.md").read_text()
    for command in re.findall(r"^(?:docker build|kubectl apply) .*$", readme, re.M):
        for word in shlex.split(command):
            if word.startswith("deploy/"):
                assert (ROOT / word).exists(), f"README: {word}"


def test_every_kubectl_command_in_the_docs_names_a_kustomization_or_a_manifest():
    kustomizations = {p.relative_to(ROOT).as_posix() for p in K8S.iterdir() if (p / "kustomization.yaml").exists()}
    seen = set()
    for page in [ROOT / "README.md", DEPLOY / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for flag, path in re.findall(r"kubectl (?:-n \S+ )?(?:apply|kustomize|delete)(?: -n \S+)? (-k|-f)? ?(deploy/\S+?)[`\s)]", page.read_text()):
            where = f"{page.relative_to(ROOT)}: kubectl {flag} {path}"
            if flag == "-f":
                assert (ROOT / path).is_file(), where
            else:
                assert path.rstrip("/") in kustomizations, where
            seen.add(path.rstrip("/"))
    assert kustomizations <= seen, f"kustomizations no doc applies: {sorted(kustomizations - seen)}"


# deploy/k8s/secure: the overlay with TLS and credentials towards etcd and NATS.

SECURE_KUSTOMIZATION = yaml.safe_load((SECURE / "kustomization.yaml").read_text())
SECURE_DOCS = {
    path.name: yaml.safe_load(path.read_text()) for path in sorted(SECURE.glob("*.yaml")) if path.name != "kustomization.yaml"
}


def secure(kind, name):
    """An object of the overlay as `kubectl kustomize` renders it: the base's with the patch
    applied, or the overlay's own."""
    return find(kind, name, stack(SECURE.name))


def test_secure_overlay_lists_its_files_and_patches_base_objects():
    assert "../base" in SECURE_KUSTOMIZATION["resources"]
    patches = {p["path"] for p in SECURE_KUSTOMIZATION["patches"]}
    resources = {r for r in SECURE_KUSTOMIZATION["resources"] if r != "../base"}
    assert patches | resources == set(SECURE_DOCS), sorted(patches ^ resources ^ set(SECURE_DOCS))
    for name in patches:
        doc = SECURE_DOCS[name]
        find(doc["kind"], doc["metadata"]["name"])
    for name in resources:
        doc = SECURE_DOCS[name]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvmesh", name


def mounted(workload, container_name, path):
    """The (volume, file) a path in `container_name` is read from, or None."""
    spec = pod_spec(workload)
    c = next(c for c in spec["containers"] if c["name"] == container_name)
    for mount in c.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/")
        if path == root or path.startswith(root + "/"):
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            return volume, mount.get("subPath") or path[len(root) + 1 :]
    return None


def assert_from_secret_or_config(workload, container_name, path):
    found = mounted(workload, container_name, path)
    assert found, f"{workload['metadata']['name']}/{container_name}: nothing mounted at {path}"
    volume, file = found
    source = volume.get("secret") or volume.get("configMap")
    assert source, f"{path}: volume {volume['name']} is not a Secret or ConfigMap"
    items = source.get("items")
    if items:
        assert file in {item["path"] for item in items}, f"{path}: {volume['name']} does not project {file}"


def secure_proxy_config():
    return yaml.safe_load(secure("ConfigMap", "kvmesh-proxy-config")["data"][PROXY_CONFIG_KEY])


def control_files(config):
    """Every file the proxy config's discovery and events sections name."""
    out = []
    for section in ("discovery", "events"):
        for block in ("tls", "auth"):
            for key, value in (config[section].get(block) or {}).items():
                if key in ("ca", "cert", "key") or key.endswith("_file"):
                    out.append(value)
    return out


def test_secure_proxy_config_passes_check_config_with_its_files():
    config = secure_proxy_config()
    assert config["discovery"]["endpoint"].startswith("https://")
    assert config["events"]["url"].startswith("tls://")
    files = control_files(config)
    assert len(files) >= 5, files
    with tempfile.TemporaryDirectory() as tmp:
        text = secure("ConfigMap", "kvmesh-proxy-config")["data"][PROXY_CONFIG_KEY]
        for path in files:
            local = Path(tmp) / path.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            name = Path(path).name
            if name.endswith("key"):
                local.write_text("-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n")
            elif name.endswith("crt"):
                local.write_text("-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n")
            else:
                local.write_text("secret\n")
            text = text.replace(path, str(local))
        config_path = Path(tmp) / "kvmesh.yaml"
        config_path.write_text(text)
        done = subprocess.run([str(BIN_DIR / "kvmesh-proxy"), "--check-config", str(config_path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_secure_overlay_mounts_every_file_it_names():
    proxy = secure("Deployment", "kvmesh-proxy")
    for path in control_files(secure_proxy_config()):
        assert_from_secret_or_config(proxy, "kvmesh-proxy", path)
    worker = secure("Deployment", "kvmesh-worker")
    agent = container(worker, "kvmesh-agent")
    opts = flags(agent["args"])
    assert opts["etcd"].startswith("https://") and opts["nats"].startswith("tls://")
    named = [value for key, value in opts.items() if key.endswith("-file")]
    assert len(named) >= 5, named
    for path in named:
        assert_from_secret_or_config(worker, "kvmesh-agent", path)
    nats = secure("StatefulSet", "nats")
    config_file = flags(container(nats, "nats")["args"])["config"]
    assert_from_secret_or_config(nats, "nats", config_file)
    nats_conf = secure("ConfigMap", "kvmesh-nats-config")["data"]["nats.conf"]
    for path in re.findall(r"(/etc/nats/\S+)", nats_conf):
        assert_from_secret_or_config(nats, "nats", path)
    etcd = secure("StatefulSet", "etcd")
    etcd_opts = flags(container(etcd, "etcd")["args"])
    assert etcd_opts["listen-client-urls"].startswith("https://") and etcd_opts["client-cert-auth"] is True
    for key in ("cert-file", "key-file", "trusted-ca-file"):
        assert_from_secret_or_config(etcd, "etcd", etcd_opts[key])
    # The kubelet's probes present no certificate: they use the plaintext metrics port.
    ports = {p["name"]: p["containerPort"] for p in container(etcd, "etcd")["ports"]}
    assert port_of(etcd_opts["listen-metrics-urls"]) == ports["metrics"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container(etcd, "etcd")[probe]["httpGet"]["port"] == "metrics"


def test_secure_overlay_flags_exist():
    text = help_text("kvmesh-agent")
    agent = container(secure("Deployment", "kvmesh-worker"), "kvmesh-agent")
    for key in flags(agent["args"]):
        assert f"--{key}" in text, f"kvmesh-agent has no --{key}"
    # Unchanged arguments stay as the base has them (the patch repeats the whole list).
    base = flags(container(find("Deployment", "kvmesh-worker"), "kvmesh-agent")["args"])
    secured = flags(agent["args"])
    for key, value in base.items():
        if key not in ("etcd", "nats"):
            assert secured.get(key) == value, f"--{key}: {secured.get(key)!r} vs the base's {value!r}"
    for kind, name, changed in [
        ("StatefulSet", "etcd", {"listen-client-urls", "advertise-client-urls"}),
        ("StatefulSet", "nats", set()),
    ]:
        base = flags(container(find(kind, name), name)["args"])
        secured = flags(container(secure(kind, name), name)["args"])
        for key, value in base.items():
            if key not in changed:
                assert secured.get(key) == value, f"{name} --{key}: {secured.get(key)!r} vs {value!r}"


# deploy/k8s/inference-pool: kvmesh as the endpoint picker of an InferencePool.

INFERENCE_KUSTOMIZATION = yaml.safe_load((INFERENCE / "kustomization.yaml").read_text())
INFERENCE_DOCS = {
    path.name: yaml.safe_load(path.read_text()) for path in sorted(INFERENCE.glob("*.yaml")) if path.name != "kustomization.yaml"
}


def inference(kind):
    return next(doc for doc in INFERENCE_DOCS.values() if doc["kind"] == kind)


def test_inference_pool_overlay_lists_its_files():
    resources = INFERENCE_KUSTOMIZATION["resources"]
    assert resources[0] == "../base" and set(resources[1:]) == set(INFERENCE_DOCS), resources
    for doc in INFERENCE_DOCS.values():
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvmesh"


def test_the_pools_picker_is_the_proxys_epp_port_and_its_endpoints_are_what_the_agents_register():
    pool = inference("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    # The picker: the Service port that reaches the proxy's epp listener.
    ref = spec["endpointPickerRef"]
    service = find("Service", ref["name"])
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    proxy = container(find("Deployment", "kvmesh-proxy"), "kvmesh-proxy")
    target = next(p["containerPort"] for p in proxy["ports"] if p["name"] == port["targetPort"])
    assert target == port_of(proxy_config()["epp"]["address"])
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    # The pods: the workers, whose agents register podIP:port, the endpoint the gateway uses.
    worker = find("Deployment", "kvmesh-worker")
    labels = pod_spec_labels(worker)
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    engine_port = next(p["containerPort"] for p in container(worker, "vllm")["ports"] if p["name"] == "http")
    assert [p["number"] for p in spec["targetPorts"]] == [engine_port]
    advertised = flags(container(worker, "kvmesh-agent")["args"])["advertise-url"]
    assert advertised == f"http://$(POD_IP):{engine_port}", advertised
    route = inference("HTTPRoute")
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}]


def pod_spec_labels(workload):
    return workload["spec"]["template"]["metadata"]["labels"]


# deploy/k8s/disaggregated: prefill and decode workers behind a disaggregated model.

DISAGGREGATED_KUSTOMIZATION = yaml.safe_load((DISAGGREGATED / "kustomization.yaml").read_text())
# The agents' --role, and vLLM's NixlConnector kv_role, of each worker Deployment.
ROLES = {"kvmesh-prefill": ("prefill", "kv_producer"), "kvmesh-decode": ("decode", "kv_consumer")}


def disaggregated():
    return stack(DISAGGREGATED.name)


def test_disaggregated_overlay_replaces_the_aggregated_workers_with_prefill_and_decode():
    files = {p.name for p in DISAGGREGATED.glob("*.yaml")} - {"kustomization.yaml"}
    resources = DISAGGREGATED_KUSTOMIZATION["resources"]
    patches = [p["path"] for p in DISAGGREGATED_KUSTOMIZATION["patches"]]
    assert resources[0] == "../base" and set(resources[1:]) | set(patches) == files, (resources, patches, files)
    docs = disaggregated()
    assert {d["metadata"]["name"] for d in objects("Deployment", docs)} == {"kvmesh-proxy", *ROLES}
    base = {(d["kind"], d["metadata"]["name"]) for d in objects() if d["kind"] != "Kustomization"}
    examples = {(d["kind"], d["metadata"]["name"]) for path, d in DOCS if path.parent == EXAMPLES}
    overlay = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert overlay == base - examples - {("Deployment", "kvmesh-worker")} | {("Deployment", name) for name in ROLES}


def test_disaggregated_proxy_config_passes_check_config_and_splits_the_model():
    docs = disaggregated()
    text = find("ConfigMap", "kvmesh-proxy-config", docs)["data"][PROXY_CONFIG_KEY]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kvmesh.yaml"
        path.write_text(text)
        done = subprocess.run([str(BIN_DIR / "kvmesh-proxy"), "--check-config", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    config = proxy_config(docs)
    [model] = config["models"]
    assert model["policy"] == "kv", "the prefill instance is chosen by the KV index"
    split = model.pop("disaggregation")
    assert split["mode"] in ("conditional", "enforce") and split.get("protocol", "vllm") == "vllm"
    # Everything else is the base's config.
    assert config == proxy_config()
    decode = flags(container(find("Deployment", "kvmesh-decode", docs), "kvmesh-agent")["args"])
    assert int(decode["kv-bytes-per-token"]) == split["kv_bytes_per_token"], "the pacer sizes transfers as the proxy does"


@pytest.mark.parametrize("name", sorted(ROLES))
def test_disaggregated_worker_runs_nixl_and_its_agent_as_inbound_sidecar_with_its_role(name):
    docs = disaggregated()
    worker = find("Deployment", name, docs)
    role, kv_role = ROLES[name]
    engine = vllm_engine(worker)
    check_agent(worker, engine, docs)
    vllm = container(worker, "vllm")
    transfer = json.loads(flags(vllm["args"])["kv-transfer-config"])
    assert transfer == {"kv_connector": "NixlConnector", "kv_role": kv_role}
    env = {e["name"]: e for e in vllm["env"]}
    # The side channel a decode engine dials, named in the prefill engine's kv_transfer_params.
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    side_channel = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
    assert side_channel in {p["containerPort"] for p in vllm["ports"]}
    agent = flags(container(worker, "kvmesh-agent")["args"])
    assert agent["role"] == role
    # The rest as the base's aggregated worker has it: the same model, engine and control plane.
    base_worker = find("Deployment", "kvmesh-worker")
    base_vllm = flags(container(base_worker, "vllm")["args"])
    assert {k: v for k, v in flags(vllm["args"]).items() if k != "kv-transfer-config"} == base_vllm
    assert positional(vllm["args"]) == positional(container(base_worker, "vllm")["args"])
    base_agent = flags(container(base_worker, "kvmesh-agent")["args"])
    sidecar = {"role", "inbound-listen", "advertise-url", "kv-bytes-per-token"}
    assert {k: v for k, v in agent.items() if k not in sidecar} == {k: v for k, v in base_agent.items() if k != "advertise-url"}
    assert worker["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port_of(agent["listen"]))
