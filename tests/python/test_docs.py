"""docs/: the index lists every page, links resolve, every proxy metric has a row in a metrics
table of docs/operations.md (type, labels, meaning)."""

import re

import pytest

from conftest import ROOT

DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")
METRIC = re.compile(r'"(kvmesh_[a-z0-9_]+)"')


def pages():
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md", ROOT / "deploy" / "README.md"]


def test_the_index_links_every_page():
    index = (DOCS / "README.md").read_text()
    linked = set(LINK.findall(index))
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert page.name in linked, f"docs/README.md does not link {page.name}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


def test_every_proxy_metric_is_in_operations():
    names = set()
    for source in (ROOT / "proxy" / "src").rglob("*.rs"):
        names |= set(METRIC.findall(source.read_text()))
    assert names, "no metric names found in proxy/src"
    operations = (DOCS / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(kvmesh_[a-z0-9_]+)` \|", operations, re.M))
    missing = sorted(names - documented)
    assert not missing, f"no row of a metrics table in docs/operations.md for {missing}"
