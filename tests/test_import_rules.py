"""The one-way flow, checked on the source: every import of every .py file, parsed with `ast`.

ingest (corpus_tools) -> store (blend_engine.kv_store) -> retrieve (retrieval) -> blend (blend_engine)
-> serve (app); settings and wiring in blendserve_config (the composition root, above corpus_tools); the
entry points app and corpus_cli above it; log hygiene (logsafe) a leaf; the vLLM side (blendserve_vllm: the
KV hand-over and the connector vLLM loads) a leaf that needs nothing but what vLLM's own environment has;
evaluation in benchmarks, on top of all.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "benchmarks", "blend_engine", "blendserve_config", "blendserve_vllm", "corpus_cli", "corpus_tools",
            "logsafe", "retrieval")
ENTRY_POINTS = {"app", "corpus_cli"}  # above the composition root: nothing but benchmarks imports them

# package -> packages it must not import
FORBIDDEN = {
    "logsafe": set(PACKAGES) - {"logsafe"},
    "blendserve_vllm": set(PACKAGES) - {"blendserve_vllm"},
    "blend_engine": {"app", "benchmarks", "retrieval", "corpus_tools", "blendserve_config", "corpus_cli"},
    "retrieval": {"app", "benchmarks", "blend_engine", "corpus_tools", "blendserve_config", "corpus_cli"},
    "corpus_tools": {"app", "benchmarks", "blendserve_config", "corpus_cli"},
    "blendserve_config": {"app", "benchmarks", "corpus_cli"},
    "corpus_cli": {"app", "benchmarks"},
    "app": {"benchmarks", "corpus_cli"},
}
# `python -m corpus_tools`, the documented command, stays: its __main__ (a process entry point that no module
# imports) is the one file of a package allowed to reach the CLI above it.
ENTRY_SHIMS = {"corpus_tools/__main__.py": {"corpus_cli"}}
# The service may call the ingestion pipeline (and hand it documents); nothing else from the CLI package.
APP_MAY_USE_FROM_CORPUS_TOOLS = {"corpus_tools.pipeline", "corpus_tools.documents", "corpus_tools.jobs"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, at any depth (function-level too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if module == "corpus_tools"]
    return found


def source_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def violations() -> list[str]:
    out = []
    for package, banned in FORBIDDEN.items():
        for path in source_files(package):
            allowed = ENTRY_SHIMS.get(path.relative_to(ROOT).as_posix(), set())
            for line, module in imported_modules(path):
                top = module.split(".")[0]
                where = f"{path.relative_to(ROOT)}:{line} imports {module}"
                if top in banned and top not in allowed:
                    out.append(where)
                elif package == "app" and top == "corpus_tools" and not any(
                        module == m or module.startswith(m + ".") for m in APP_MAY_USE_FROM_CORPUS_TOOLS):
                    out.append(where + " (the service may use only the ingestion pipeline)")
    return out


def package_graph() -> dict[str, set[str]]:
    """package -> the other project packages its modules import (entry-point shims left out)."""
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for path in source_files(package):
            if path.relative_to(ROOT).as_posix() in ENTRY_SHIMS:
                continue
            graph[package] |= {m.split(".")[0] for _, m in imported_modules(path)} & set(PACKAGES) - {package}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle between packages, as a path that returns to its start; [] when there is none."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return []


def test_the_packages_import_each_other_without_a_cycle():
    assert cycle(package_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycle({"corpus_tools": {"blendserve_config"}, "blendserve_config": {"corpus_tools"}}) == [
        "blendserve_config", "corpus_tools", "blendserve_config"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_only_benchmarks_import_the_entry_points():
    graph = package_graph()
    assert {p for p, deps in graph.items() if deps & ENTRY_POINTS} <= {"benchmarks"}


def test_every_package_is_checked():
    assert all(source_files(p) for p in PACKAGES)
    assert set(FORBIDDEN) <= set(PACKAGES)


def test_the_import_rules_hold():
    assert violations() == []


VLLM_ENV = {"torch", "numpy", "vllm", "blendserve_vllm"}  # what a stock vLLM image has, and the package itself


def test_the_connector_needs_only_what_vllms_environment_has():
    """A stock vLLM image loads `blendserve_vllm` from a mounted folder: it imports the standard
    library, torch, numpy and vLLM, nothing else."""
    stdlib = set(sys.stdlib_module_names)
    found = {module.split(".")[0] for path in source_files("blendserve_vllm") for _, module in imported_modules(path)}
    assert found - stdlib - {"__future__"} <= VLLM_ENV
    assert "vllm" in found  # the check sees the connector's imports


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "blend_engine"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from retrieval.text import format_passage\n    from . import types\n"
                              "import benchmarks.scoring as s\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [m for _, m in imported_modules(pkg / "x.py")] == ["benchmarks.scoring", "retrieval.text", "blend_engine"]
    assert len(violations()) == 2


@pytest.mark.parametrize("statement", [
    "from blendserve_config.settings import Settings; Settings(_env_file=None)",
    "from app.settings import ServiceSettings; ServiceSettings(_env_file=None)",
    "import blend_engine; from blend_engine.types import Mode; blend_engine.Mode",
    "import retrieval.text",
])
def test_light_imports_do_not_load_torch(statement):
    code = f"import sys; {statement}; sys.exit(int('torch' in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"{statement!r} loaded torch (or failed): {proc.stderr[-2000:]}"


def _module_level_imports(path: Path) -> set[str]:
    """Absolute names imported when the module runs: top-level statements only (not inside functions
    or `if TYPE_CHECKING:` blocks), each `from m import x` as both m and m.x."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base) if node.level else node.module or ""
            out |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return out


def test_the_engine_modules_form_no_import_cycle():
    """engine.py is a facade: scheduler, executor, chunk cache and loop never import it (or each
    other) back, so no blend_engine module needs another half-initialised."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in source_files("blend_engine")}
    graph = {m: {d for d in _module_level_imports(p) if d in files and d != m} for m, p in files.items()}
    _assert_acyclic(graph)


def test_the_retrieval_modules_import_each_other_without_a_cycle():
    """Not even through a function-level import (retriever <-> sync was one: the embedding helpers
    they share live in retrieval/vectors.py)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in source_files("retrieval") if p.name != "__init__.py"}
    graph = {m: {d for _, d in imported_modules(p) if d in files and d != m} for m, p in files.items()}
    _assert_acyclic(graph)


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*path, m, d]
            if d not in state and (cycle := visit(d, [*path, m])):
                return cycle
        state[m] = 2
        return None

    cycles = [c for m in sorted(graph) if m not in state and (c := visit(m, []))]
    assert cycles == [], " -> ".join(cycles[0])


def test_the_scheduler_holds_no_torch():
    code = ("import sys; import blend_engine.scheduler.plans, blend_engine.scheduler.budget, "
            "blend_engine.scheduler.batch, blend_engine.scheduler.controller; sys.exit(int('torch' in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"the scheduler loaded torch (or failed): {proc.stderr[-2000:]}"


SERVING = ("app", "blendserve_config", "corpus_tools", "corpus_cli", "retrieval", "blendserve_vllm")
SEAM = {"prefill", "decode_step"}  # `BlendEngine`'s research and test seam: outside the engine loop and its pool


def seam_calls(path: Path) -> list[tuple[int, str]]:
    """Calls of `<anything>.prefill(...)` / `<anything>.decode_step(...)` in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(n.lineno, n.func.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in SEAM]


def test_nothing_that_serves_calls_the_engines_research_seam():
    """Issue #58 item 2: the service, the CLI and ingestion reach the engine through the one surface the
    service uses (the engine loop); the synchronous prefill / decode_step seam is for tests and benchmarks."""
    found = {f"{p.relative_to(ROOT)}:{line}": name for pkg in SERVING for p in source_files(pkg)
             for line, name in seam_calls(p)}
    assert not found, found


def test_the_seam_check_sees_a_call(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f(engine):\n    return engine.prefill(plan).logits\n")
    assert seam_calls(f) == [(2, "prefill")]
