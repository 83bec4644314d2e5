"""deploy/: what a cluster's API server would say about the manifests.

Every kustomization under deploy/ is rendered by the real `kubectl kustomize` (as `kubectl
apply -k` renders it), and every object it renders, and every plain manifest beside them, is
validated against the Kubernetes API's schemas of the newest release the pinned
kubernetes-validate ships, strictly (an unknown field is an error, as under kubectl's default
`--validate=strict`), or, for the Gateway API Inference Extension's InferencePool and the
Gateway API's HTTPRoute, against their CRDs' `openAPIV3Schema`, vendored in tests/python/crds.
The CRDs' CEL rules (`x-kubernetes-validations`) are not evaluated.
"""

import copy
import re

import pytest
import yaml
from packaging.version import Version

from k8s_manifests import (
    CRDS,
    DEPLOY,
    KUBERNETES_VERSION,
    YAML_LOADER,
    crd_validators,
    kustomizations,
    plain_manifests,
    problems,
    render,
)
from kvmesh_processes import ROOT

NAMESPACE = "kvmesh"


def rel(path):
    return str(path.relative_to(ROOT))


def test_every_kustomization_under_deploy_is_found():
    assert [rel(p) for p in kustomizations()] == [
        "deploy/k8s/base",
        "deploy/k8s/disaggregated",
        "deploy/k8s/inference-pool",
        "deploy/k8s/secure",
    ]
    assert [rel(p) for p in plain_manifests()] == ["deploy/k8s/examples/sim-worker.yaml"]


@pytest.mark.parametrize("directory", kustomizations(), ids=rel)
def test_kustomization_renders_and_a_cluster_accepts_every_object(directory):
    objects = render(directory)
    kinds = {obj["kind"] for obj in objects}
    assert {"Namespace", "Deployment", "StatefulSet", "Service", "ConfigMap"} <= kinds, kinds
    errors = [problem for obj in objects for problem in problems(obj)]
    assert not errors, "\n".join(errors)
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("path", plain_manifests(), ids=rel)
def test_plain_manifest_is_accepted(path):
    objects = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert objects
    errors = [problem for obj in objects for problem in problems(obj)]
    assert not errors, "\n".join(errors)


def test_the_newest_kubernetes_schemas_are_used():
    # kubernetes-validate 1.37.0 (tests/python/requirements.txt) ships schemas up to 1.37.
    assert Version(KUBERNETES_VERSION) >= Version("1.37"), KUBERNETES_VERSION


def test_the_vendored_crds_are_the_versions_and_licences_their_readme_names():
    readme = (CRDS / "README.md").read_text()
    crds = sorted(CRDS.glob("*/*.yaml"))
    assert [p.name for p in crds] == [
        "inference.networking.k8s.io_inferencepools.yaml",
        "gateway.networking.k8s.io_httproutes.yaml",
    ]
    for path in crds:
        project, version = re.fullmatch(r"(.+)-(v\d+\.\d+\.\d+)", path.parent.name).groups()
        crd = yaml.load(path.read_text(), Loader=YAML_LOADER)
        bundle = [v for k, v in crd["metadata"]["annotations"].items() if k.endswith("/bundle-version")]
        assert bundle == [version], f"{rel(path)}: bundle-version {bundle}"
        assert "Apache License" in (path.parent / "LICENSE").read_text()
        assert f"`{path.parent.name}/{path.name}`" in readme and version in readme and project in readme
    assert set(crd_validators()) == {
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
        ("gateway.networking.k8s.io/v1beta1", "HTTPRoute"),
    }


def rendered(directory, kind, name=None):
    for obj in render(DEPLOY / "k8s" / directory):
        if obj["kind"] == kind and (name is None or obj["metadata"]["name"] == name):
            return copy.deepcopy(obj)
    raise AssertionError(f"{directory}: no {kind}/{name}")


def broken(obj, edit):
    out = copy.deepcopy(obj)
    edit(out)
    return out


def rejected(obj, path_part):
    """The object's problems, asserted to be there and to name `path_part`."""
    found = problems(obj)
    assert found, f"accepted: {obj}"
    assert any(path_part in p for p in found), found
    return found


def test_the_validators_reject_broken_objects():
    """The same validators reject what an API server would: an unknown field, a wrong type, a
    missing required field, a value out of range, an unknown kind or version."""
    deployment = rendered("base", "Deployment", "kvmesh-proxy")
    assert problems(deployment) == []
    rejected(broken(deployment, lambda d: d["spec"].update(replica=2)), "replica")
    rejected(
        broken(deployment, lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="8080")),
        "containerPort",
    )
    rejected(broken(deployment, lambda d: d["spec"].pop("selector")), "selector")
    rejected(broken(deployment, lambda d: d["metadata"]["labels"].update(tier=3)), "labels")
    rejected(broken(deployment, lambda d: d.update(apiVersion="apps/v1beta9")), "no CRD")
    configmap = rendered("base", "ConfigMap", "kvmesh-proxy-config")
    rejected(broken(configmap, lambda d: d.update(datas=d["data"])), "datas")

    pool = rendered("inference-pool", "InferencePool")
    assert problems(pool) == []
    rejected(broken(pool, lambda d: d["spec"]["targetPorts"][0].update(number=70000)), "targetPorts.0.number")
    rejected(broken(pool, lambda d: d["spec"].pop("targetPorts")), "targetPorts")
    rejected(broken(pool, lambda d: d["spec"]["endpointPickerRef"].pop("name")), "endpointPickerRef")
    rejected(broken(pool, lambda d: d["spec"]["endpointPickerRef"].update(failureMode="FailSometimes")), "failureMode")
    rejected(broken(pool, lambda d: d["spec"].update(extensionRef={"name": "kvmesh-proxy"})), "extensionRef")
    rejected(broken(pool, lambda d: d["metadata"].update(labels={"a": ["b"]})), "metadata.labels")

    route = rendered("inference-pool", "HTTPRoute")
    assert problems(route) == []
    rejected(broken(route, lambda d: d["spec"]["rules"][0]["matches"][0]["path"].update(type="Glob")), "path.type")
    rejected(broken(route, lambda d: d["spec"]["rules"][0]["backendRefs"][0].update(weight=-1)), "weight")
    rejected(broken(route, lambda d: d["spec"]["rules"][0]["backendRefs"][0].update(namespaces="kvmesh")), "namespaces")
    rejected(broken(route, lambda d: d.update(apiVersion="gateway.networking.k8s.io/v2")), "no CRD")
