"""The README and docs/ stay true to the tree: the README short, every relative link and
anchor there, every command the README names a real CLI command or make target, and every
benchmark command of docs/performance.md a script that takes those flags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def code_blocks(text: str) -> str:
    """The lines inside ``` fences."""
    return "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S))


def prose(text: str) -> str:
    """The text outside ``` fences."""
    return re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)


def anchors(path: Path) -> set[str]:
    """GitHub's ids of a Markdown file's headings."""
    ids = set()
    for line in prose(path.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().replace("`", "").lower()
            ids.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return ids


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 150


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_and_anchors_exist(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (
            anchor and linked.suffix == ".md" and anchor not in anchors(linked)
        ):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_readme_commands_exist() -> None:
    text = README.read_text()
    commands = set(re.findall(r"jupyter gpu-snapshot ([a-z][a-z-]*)", text))
    parser = build_parser()
    [subparsers] = [a for a in parser._actions if a.choices and "save" in a.choices]
    assert commands and commands <= set(subparsers.choices), commands - set(subparsers.choices)
    targets = set(re.findall(r"^make ([a-z][a-z-]*)", code_blocks(text), flags=re.M))
    makefile = (ROOT / "Makefile").read_text()
    assert {"lab", "test"} <= targets
    missing = {t for t in targets if not re.search(rf"^{t}:", makefile, flags=re.M)}
    assert not missing


def test_performance_commands_take_their_flags() -> None:
    text = (ROOT / "docs" / "performance.md").read_text()
    flag = r"--[a-z][a-z0-9-]*"
    runs = re.findall(rf"(bench_[a-z_]+)\.py((?: {flag}(?: [\w.,]+)*)*)`", text)
    assert len(runs) > 10
    for script, args in runs:
        source = (ROOT / "benchmarks" / f"{script}.py").read_text()
        for name in re.findall(flag, args):
            assert f'"{name}"' in source, f"{script}.py has no {name}"
    # Flags given without their script (a table's column) belong to some benchmark, or are
    # criu's own.
    sources = "".join(p.read_text() for p in (ROOT / "benchmarks").glob("bench_*.py"))
    criu_flags = {"--leave-running", "--tcp-close", "--unprivileged"}
    for span in re.findall(r"`([^`]*)`", text):
        for name in re.findall(rf"(?<![\w-]){flag}", span):
            assert f'"{name}"' in sources or name in criu_flags, name
