"""The codebase's shape: the package reads downward only (no import cycle, function-local imports
counted), and the README's layout and config keys match the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body (function-local too)."""
    mods = {
        ".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                top = base[: len(base) - node.level + 1] if node.level else []
                target = ".".join(top + ([node.module] if node.module else []))
                names = [target, *(f"{target}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod and name != package.name:
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a -> b -> ... -> a), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return path[path.index(v) :] + [v]
            if v not in state and (found := visit(v)):
                return found
        state[u] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph(ROOT / "pipeline"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_function_local_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("import pkg.b\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("def f():\n    import json\n")  # the cycle broken
    assert find_cycle(import_graph(pkg)) is None


def layout_paths(readme: str) -> set[str]:
    """The files the README's Layout tree names (one name per line, two spaces a level)."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    stack: list[str] = []
    out = set()
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        stack = stack[:depth] + [name.rstrip("/")]
        if not name.endswith("/"):
            out.add("/".join(stack))
    return out


def test_readme_layout_names_every_module_and_benchmark_script():
    named = layout_paths((ROOT / "README.md").read_text())
    files = {
        str(p.relative_to(ROOT))
        for folder in ("pipeline", "benchmarks")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".sh") and p.name != "__init__.py"
    }
    listed = {p for p in named if p.split("/")[0] in ("pipeline", "benchmarks")}
    assert files - listed == set(), "in the tree, not in the README's layout"
    assert listed - files == set(), "in the README's layout, not in the tree"


NOT_KEYS = {"py", "yaml", "json", "jsonl", "md", "sh", "log", "lock", "png", "txt"}


@pytest.mark.parametrize(
    "doc", ["README.md", "docs/pipeline.md", "docs/serving.md", "docs/vllm.md"]
)
def test_every_config_key_the_manual_names_exists(doc):
    from pipeline.config import Config

    sections = {name: field.annotation for name, field in Config.model_fields.items()}
    text = (ROOT / doc).read_text()
    pattern = r"\b(" + "|".join(sections) + r")\.([a-z_]+)\b(?![.\w])"  # not a module path
    named = {(s, k) for s, k in re.findall(pattern, text) if k not in NOT_KEYS}
    assert named, "the pattern found nothing: the check checks nothing"
    missing = sorted(f"{s}.{k}" for s, k in named if k not in sections[s].model_fields)
    assert missing == [], f"{doc} names config keys that do not exist"


DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_no_dated_story_in_the_package():
    """Dated measurements live in docs/measurements.md, not in pipeline/'s code or docstrings."""
    dated = [
        f"{p.relative_to(ROOT)}:{n}: {m.group()}"
        for p in sorted((ROOT / "pipeline").rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if (m := DATE.search(line))
    ]
    assert not dated, "dates in pipeline/ (move the story to docs/measurements.md):\n" + "\n".join(
        dated
    )


def test_no_module_in_the_package_over_500_lines():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted((ROOT / "pipeline").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 500
    ]
    assert not long, "modules in pipeline/ over 500 lines (split them by job):\n" + "\n".join(long)


def test_the_readme_stays_a_manual():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 350, f"README.md is {n} lines, over 350: move figures to docs/measurements.md"
