"""The docs point at things that exist: relative links and their anchors, make targets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "docker" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# `make X` in inline code, or a command line that starts with make (code blocks).
MAKE = re.compile(r"(?:^|`)\s*make ([a-z][a-z-]*)\b", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose = FENCE.sub("", path.read_text())
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", prose, re.MULTILINE)}


def relative_links(path: Path) -> list[str]:
    prose = FENCE.sub("", path.read_text())
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:", t)]


def makefile_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*)(?: [a-z][a-z-]*)*:", makefile, re.MULTILINE))


def test_the_docs_pages_are_found():
    names = {p.name for p in DOCS}
    assert {"architecture.md", "configuration.md", "operations.md", "gpu.md"} <= names
    assert sum(len(relative_links(p)) for p in DOCS) > 30


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in relative_links(doc):
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(f"{target}: no {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_make_target_named_exists(doc):
    targets = makefile_targets()
    named = set(MAKE.findall(doc.read_text()))
    assert named - targets == set(), f"{doc.name} names make targets the Makefile lacks"


def test_the_readme_shows_the_commands_ci_and_newcomers_run():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert len(readme.splitlines()) <= 220  # a first page, with the rest in docs/


def test_the_anchor_rule_matches_githubs():
    assert github_anchor("Quick start (CPU)") == "quick-start-cpu"
    assert github_anchor("The `make` variables") == "the-make-variables"
    assert github_anchor("Where the front door's time goes") == "where-the-front-doors-time-goes"
    assert (
        github_anchor("GPU boxes: TensorRT-LLM, the GPU image")
        == "gpu-boxes-tensorrt-llm-the-gpu-image"
    )


# A path of the project's own code named in a doc: `serve/api/openai/routes.py`, or a
# folder such as `serve/engines/triton/`.
CODE_PATH = re.compile(
    r"(?<![\w/.-])((?:serve|tritonllm|build_engines|bench|tests|scripts|docker|model_repository)"
    r"/[\w/.-]*[\w/])"
)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_path_named_exists(doc):
    """Files move (the packages per API dialect, the engines side by side): a doc that
    names the old place fails here, not in a reader's editor."""
    named = set(CODE_PATH.findall(doc.read_text()))
    missing = sorted(p for p in named if not _exists(p.rstrip("."), doc.parent))
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def _exists(path: str, doc_folder: Path) -> bool:
    """From the root or the doc's folder (docs/bench/ runs are linked as bench/...); a
    name cut before its ``*`` (``capacity-per-request-*``) is the start of a file's."""
    for base in (ROOT, doc_folder):
        whole = base / path
        if whole.exists() or any(whole.parent.glob(whole.name + "*")):
            return True
    return False
