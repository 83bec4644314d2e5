"""deploy/'s Kubernetes manifests as a cluster gets them: every kustomization rendered by the
real `kubectl kustomize`, and validators for what it renders (the Kubernetes API's schemas
from PyPI's kubernetes-validate, the Gateway API and Inference Extension CRDs vendored in
tests/python/crds). Used by test_manifests.py and test_deploy.py."""

import copy
import functools
import importlib.resources
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils
from packaging.version import Version
from referencing import Registry, Resource

from kvmesh_processes import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CRDS = Path(__file__).parent / "crds"
KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
# libyaml's loader where PyYAML has it: the HTTPRoute CRD alone is 430 kB.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# The newest Kubernetes release whose schemas the pinned kubernetes-validate ships.
KUBERNETES_VERSION = str(max(Version(v) for v in kv_utils.all_versions()))
KUBERNETES_MINOR = kv_utils.major_minor(KUBERNETES_VERSION)
OBJECT_META = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"

# The OpenAPI v3 keywords the vendored CRDs use, as JSON Schema reads them (the `x-kubernetes-`
# ones are the API server's: list semantics and CEL rules, which JSON Schema does not check).
OPENAPI_KEYWORDS = {
    "type", "properties", "required", "items", "enum", "default", "description", "format",
    "pattern", "minLength", "maxLength", "minimum", "maximum", "minItems", "maxItems",
    "minProperties", "maxProperties", "additionalProperties",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}


def kustomizations():
    """Every directory under deploy/ that kustomize builds, sorted."""
    return sorted({path.parent for name in KUSTOMIZATION_NAMES for path in DEPLOY.rglob(name)})


def plain_manifests():
    """YAML files under deploy/k8s that no kustomization lists, applied with `kubectl apply -f`."""
    roots = kustomizations()
    return sorted(p for p in K8S.rglob("*.yaml") if not any(root == p.parent for root in roots))


def kubectl():
    """The kubectl to render with: $KUBECTL, else the one on PATH, else the venv's (which
    scripts/setup.sh installs from PyPI where the machine has none)."""
    found = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not found and (Path(sys.executable).parent / "kubectl").exists():
        found = str(Path(sys.executable).parent / "kubectl")
    if not found:
        pytest.fail(
            "kubectl not found ($KUBECTL, PATH, the venv): the manifests under deploy/ are "
            "rendered with the real `kubectl kustomize`; run scripts/setup.sh, which installs "
            "it where the machine has none",
            pytrace=False,
        )
    return found


@functools.cache
def render(directory):
    """The objects `kubectl kustomize DIRECTORY` prints (treat them as read-only: cached)."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {Path(directory).relative_to(ROOT)}:\n{done.stderr}"
    return tuple(doc for doc in yaml.load_all(done.stdout, Loader=YAML_LOADER) if doc)


@functools.cache
def _object_meta_registry():
    schemas = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    definitions = schemas / f"v{KUBERNETES_VERSION}-local-strict" / "_definitions.json"
    return Resource.from_contents(json.loads(definitions.read_text())) @ Registry()


def _strict(schema, where):
    """The CRD's OpenAPI schema as JSON Schema that, like the API server under kubectl's default
    `--validate=strict`, rejects unknown fields: `additionalProperties: false` on every object
    with `properties`. Fails on a keyword it does not know how to read."""
    if not isinstance(schema, dict):
        return schema
    unknown = set(schema) - OPENAPI_KEYWORDS
    assert not unknown, f"{where}: OpenAPI keywords {sorted(unknown)} are not translated"
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {k: _strict(v, f"{where}.{k}") for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    if isinstance(schema.get("items"), dict):
        out["items"] = _strict(schema["items"], f"{where}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(schema["additionalProperties"], f"{where}.*")
    return out


@functools.cache
def crd_validators():
    """{(apiVersion, kind): validator} for every served version of every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*/*.yaml")):
        crd = yaml.load(path.read_text(), Loader=YAML_LOADER)
        assert crd["kind"] == "CustomResourceDefinition", path
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if not version["served"]:
                continue
            schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
            schema = _strict(schema, f"{kind} {version['name']}")
            # The API server checks every object's metadata as ObjectMeta, whatever the CRD says.
            schema["properties"]["metadata"] = {"$ref": OBJECT_META}
            validator = jsonschema.Draft202012Validator(schema, registry=_object_meta_registry())
            out[(f"{group}/{version['name']}", kind)] = validator
    return out


def problems(obj):
    """Why a cluster would reject `obj` (an empty list when nothing): the Kubernetes schemas
    of KUBERNETES_VERSION, strict (unknown fields rejected), or the vendored CRD's."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    crd = crd_validators().get((obj.get("apiVersion"), obj.get("kind")))
    if crd is not None:
        return [
            f"{name}: {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in sorted(crd.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
        ]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_MINOR, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{name}: {'.'.join(map(str, e.path)) or '(root)'}: {e.message}"]
    except kv_utils.SchemaNotFoundError as e:
        return [f"{name}: {e.message}, and no CRD in {CRDS.relative_to(ROOT)} defines it"]
    return []
