"""What a PromQL expression names, and what a Prometheus text exposition exports: enough
to check that a dashboard's or an alert's query asks only for series kvmesh exports.

`names(expr)` tokenizes the expression (strings, ranges, numbers, identifiers, operators)
and returns its selectors (metric name and the labels its matchers name) and the labels of
its `by` / `without` / `on` / `ignoring` / `group_left` / `group_right` clauses. Grafana's
variables (`$model`, `$__rate_interval`) only ever stand in strings and ranges here, which the
tokenizer skips whole.
"""

import re
from dataclasses import dataclass, field

TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
    | (?P<range>\[[^\]]*\])
    | (?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<id>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^=<>(){},])
    )""",
    re.VERBOSE,
)
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
# Aggregations, which may take their `by (...)` before their argument.
AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
}
MATCH_OPS = {"=", "!=", "=~", "!~"}


@dataclass
class Names:
    """The selectors (metric, matcher labels) and grouping labels of one expression."""

    selectors: list = field(default_factory=list)
    grouping: set = field(default_factory=set)


def tokens(expr):
    out, at = [], 0
    while at < len(expr):
        if expr[at:].strip() == "":
            break
        m = TOKEN.match(expr, at)
        if not m or m.end() == at:
            raise ValueError(f"cannot tokenize {expr[at:]!r} in {expr!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        at = m.end()
    return out


def names(expr):
    """The metric names, matcher labels and grouping labels `expr` names."""
    toks = tokens(expr)
    result = Names()
    i = 0

    def expect(value):
        nonlocal i
        if i >= len(toks) or toks[i][1] != value:
            raise ValueError(f"expected {value!r} at token {i} of {expr!r}")
        i += 1

    def matchers():
        nonlocal i
        expect("{")
        labels = []
        while toks[i][1] != "}":
            kind, label = toks[i]
            if kind != "id" or toks[i + 1][1] not in MATCH_OPS or toks[i + 2][0] != "str":
                raise ValueError(f"bad matcher at token {i} of {expr!r}")
            labels.append(label)
            i += 3
            if toks[i][1] == ",":
                i += 1
        expect("}")
        return labels

    while i < len(toks):
        kind, value = toks[i]
        following = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "id" and value in GROUPING and following == "(":
            i += 2
            while toks[i][1] != ")":
                if toks[i][0] != "id":
                    raise ValueError(f"bad label list at token {i} of {expr!r}")
                result.grouping.add(toks[i][1])
                i += 1
                if toks[i][1] == ",":
                    i += 1
            expect(")")
        elif kind == "id" and value in GROUPING:
            i += 1  # group_left / group_right without a label list
        elif kind == "id" and (following == "(" or value in AGGREGATIONS):
            i += 1  # a function or an aggregation
        elif kind == "id" and value.lower() in KEYWORDS:
            i += 1
        elif kind == "id":
            i += 1
            labels = matchers() if following == "{" else []
            result.selectors.append((value, labels))
        elif value == "{":
            raise ValueError(f"a selector without a metric name in {expr!r}")
        else:
            i += 1
    return result


SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:\\.|[^"\\])*)"')
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


class Exposition:
    """The series of one or more Prometheus text expositions: names (with the sample names
    of histograms and summaries), each name's label names, and the samples."""

    def __init__(self):
        self.labels = {}  # name -> set of label names seen on its samples
        self.samples = []  # (name, {label: value}, value)

    def add(self, text):
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, family, kind = line.split()[:4]
                for suffix in SUFFIXES.get(kind, ("",)):
                    self.labels.setdefault(family + suffix, set())
            elif line and not line.startswith("#"):
                m = SAMPLE.match(line)
                if not m:
                    raise ValueError(f"not a sample line: {line!r}")
                name, body, value = m.groups()
                labels = dict(LABEL.findall(body or ""))
                self.labels.setdefault(name, set()).update(labels)
                self.samples.append((name, labels, float(value)))
        return self

    def value(self, name, **match):
        """The sum of the samples of `name` whose labels include `match`."""
        return sum(
            v for n, labels, v in self.samples
            if n == name and all(labels.get(k) == w for k, w in match.items())
        )

    def has_sample(self, name):
        return any(n == name for n, _, _ in self.samples)


# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}


def unknown_names(expr, exported):
    """What `expr` names that `exported` (an Exposition) does not export: a list of
    messages, empty when everything is exported."""
    found = names(expr)
    problems = []
    labels_in_expr = set(TARGET_LABELS)
    for metric, labels in found.selectors:
        if metric not in exported.labels:
            problems.append(f"metric {metric} is not exported")
            continue
        known = exported.labels[metric] | TARGET_LABELS
        labels_in_expr |= known
        problems += [f"{metric} has no label {label}" for label in labels if label not in known]
    problems += [
        f"grouping label {label} is on none of {[m for m, _ in found.selectors]}"
        for label in sorted(found.grouping - labels_in_expr)
    ]
    return problems
