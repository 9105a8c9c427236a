"""The metric names the shipped Grafana dashboard (docs/grafana/) queries."""

from __future__ import annotations

import json
import re

from tests.conftest import ROOT

DASHBOARD = ROOT / "docs" / "grafana" / "triton-ray-llm.json"

# PromQL words that look like names: operators, modifiers and the label grouping
# clauses (whose label lists are removed before names are read).
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def expressions(dashboard: dict) -> list[str]:
    panels = dashboard["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The series names ``expr`` selects (functions, labels and keywords left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings (label values)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # matchers, ranges
    expr = _GROUPING.sub("", expr)
    names = set()
    for found in re.finditer(r"(?<![\w$.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        if not found.group(2) and found.group(1).lower() not in _KEYWORDS:
            names.add(found.group(1))
    return names


def queried_metrics() -> set[str]:
    """Every series name the dashboard's panels and variables query."""
    dashboard = json.loads(DASHBOARD.read_text())
    names = set().union(*(metric_names(e) for e in expressions(dashboard)))
    for variable in dashboard["templating"]["list"]:
        query = variable.get("definition", "")
        names |= set(re.findall(r"label_values\(([a-zA-Z_:][\w:]*)", query))
    return names
