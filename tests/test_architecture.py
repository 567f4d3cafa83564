"""The dependency rule between kdaserve's top-level packages, checked on the import graph.

Each package may import only leftward, lowest layer first:
kernels <- attention, layers <- models <- spec_decode <- worker <- engine <- entrypoints.
``config`` is a leaf (it imports no package of kdaserve), and so are ``sampling_params`` and
``outputs``; ``request`` imports only ``sampling_params``. ``attention``, ``sample`` and
``structured_output`` (the grammar backend and the engine core's grammar state) sit on the
kernels; ``layers`` uses attention (never the sampler); ``spec_decode`` may read ``core``'s
scheduler-output types. ``core/`` imports only config, request and sampling params and never
touches ``torch.cuda``: it is pure scheduling and cache bookkeeping, unit-testable on CPU.
``distributed`` (process groups and the collectives; imports only config) is a leaf beside
``kernels``: ``attention``, ``layers``, ``models``, ``spec_decode`` and everything above may
import it. ``disagg`` (config, core, distributed) is used by worker / engine (and bench,
entrypoints), never the reverse. No import cycles between packages.

``ALLOWED`` below is that rule as a table. Top-level modules (``config.py``, ``request.py``, ...)
count as packages. The root module ``kdaserve/__init__.py`` re-exports ``LLM`` and
``SamplingParams`` for users, so it is exempt both ways. Every import counts, including one inside
a function (a lazy import is still a dependency); only imports under ``if TYPE_CHECKING:`` are
exempt, since they never run.
"""

from __future__ import annotations

import ast
import textwrap
from collections import deque
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")   # the test extra installs it; GPU images may lack it

import kdaserve

ROOT = "kdaserve"

# package -> the kdaserve packages it may import (besides itself). Layers, lowest first.
ALLOWED: dict[str, set[str]] = {
    # 0. leaves
    "config": set(),
    "sampling_params": set(),
    "outputs": set(),
    "request": {"sampling_params"},
    # 1. (distributed: process groups and collectives, beside the kernels)
    "kernels": set(),
    "distributed": {"config"},
    # 2.
    "attention": {"kernels", "config", "sampling_params", "outputs", "distributed"},
    "sample": {"kernels", "config", "sampling_params", "outputs"},
    "structured_output": {"kernels", "config", "sampling_params", "outputs"},
    # 3.
    "layers": {"attention", "kernels", "config", "distributed"},
    # 4.
    "models": {"layers", "attention", "kernels", "config", "distributed"},
    # 5. (core: the scheduler-output types)
    "spec_decode": {"models", "layers", "attention", "sample", "structured_output", "kernels",
                    "config", "sampling_params", "outputs", "core", "distributed"},
    # 6.
    "worker": {"spec_decode", "models", "layers", "attention", "sample", "structured_output",
               "kernels", "config", "sampling_params", "outputs", "request", "core",
               "distributed", "disagg"},
    # 7.
    "engine": {"worker", "spec_decode", "models", "layers", "attention", "sample",
               "structured_output", "kernels", "config", "sampling_params", "outputs",
               "request", "core", "distributed", "disagg"},
    # 8.
    "bench": {"engine", "worker", "spec_decode", "models", "layers", "attention", "sample",
              "structured_output", "kernels", "config", "sampling_params", "outputs",
              "request", "core", "distributed", "disagg"},
    # 9.
    "entrypoints": {"bench", "engine", "worker", "spec_decode", "models", "layers", "attention",
                    "sample", "structured_output", "kernels", "config", "sampling_params",
                    "outputs", "request", "core", "distributed", "disagg"},
    # beside the layers
    "core": {"config", "request", "sampling_params"},
    "disagg": {"config", "core", "distributed"},
}


def _top(module: str) -> str | None:
    """'kdaserve.worker.model_runner' -> 'worker'; the root module itself -> None (exempt)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _build_graph(package: str) -> grimp.ImportGraph:
    return grimp.build_graph(
        package, include_external_packages=False, exclude_type_checking_imports=True,
        cache_dir=None,
    )


def _cross_imports(graph: grimp.ImportGraph) -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> 'module -> module (line N)' for every import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for importer in sorted(graph.modules):
        src = _top(importer)
        if src is None:
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            dst = _top(imported)
            if dst is None or dst == src:
                continue
            for d in graph.get_import_details(importer=importer, imported=imported):
                edges.setdefault((src, dst), []).append(
                    f"{importer} -> {imported} (line {d['line_number']}: {d['line_contents']})"
                )
    return edges


def _cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Every distinct shortest cycle through each package-level edge (as a closed path)."""
    succ: dict[str, set[str]] = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)

    def path(start: str, goal: str) -> list[str] | None:
        prev = {start: start}
        todo = deque([start])
        while todo:
            node = todo.popleft()
            if node == goal:
                out = [node]
                while out[-1] != start:
                    out.append(prev[out[-1]])
                return out[::-1]
            for nxt in sorted(succ.get(node, ())):
                if nxt not in prev:
                    prev[nxt] = node
                    todo.append(nxt)
        return None

    seen, cycles = set(), []
    for a, b in sorted(edges):
        back = path(b, a)
        if back is None:
            continue
        cycle = [a] + back  # a -> b -> ... -> a
        ring = cycle[:-1]
        i = ring.index(min(ring))
        key = tuple(ring[i:] + ring[:i])
        if key not in seen:
            seen.add(key)
            cycles.append(list(key) + [key[0]])
    return sorted(cycles, key=lambda c: (len(c), c))


def _torch_cuda_uses(source: str, filename: str = "<src>") -> list[str]:
    """Lines where `source` touches torch.cuda: `torch.cuda...`, `import torch.cuda`,
    `from torch.cuda import ...`, `from torch import cuda`."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute):
            value = node.value
            bad = node.attr == "cuda" and isinstance(value, ast.Name) and value.id == "torch"
        elif isinstance(node, ast.Import):
            bad = any(a.name == "torch.cuda" or a.name.startswith("torch.cuda.")
                      for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            bad = mod == "torch.cuda" or mod.startswith("torch.cuda.") or (
                mod == "torch" and any(a.name == "cuda" for a in node.names)
            )
        else:
            continue
        if bad:
            hits.append(f"{filename}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return hits


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return _build_graph(ROOT)


@pytest.fixture(scope="module")
def edges(graph) -> dict[tuple[str, str], list[str]]:
    return _cross_imports(graph)


def test_grimp_counts_lazy_imports_and_exempts_type_checking(tmp_path, monkeypatch):
    """The rule is only as good as the graph: a function-level import must be an edge, an
    `if TYPE_CHECKING:` import must not."""
    pkg = tmp_path / "archtoy"
    pkg.mkdir()
    for name in ("__init__", "lazy", "lazy_method", "eager", "tc_only", "tc_only_qualified"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "user.py").write_text(textwrap.dedent("""
        import typing
        from typing import TYPE_CHECKING

        from archtoy import eager

        if TYPE_CHECKING:
            from archtoy import tc_only
        if typing.TYPE_CHECKING:
            import archtoy.tc_only_qualified


        def f():
            from archtoy import lazy
            return lazy


        class C:
            def m(self):
                from . import lazy_method
                return lazy_method
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    toy = _build_graph("archtoy")
    assert toy.find_modules_directly_imported_by("archtoy.user") == {
        "archtoy.eager", "archtoy.lazy", "archtoy.lazy_method",
    }
    (detail,) = toy.get_import_details(importer="archtoy.user", imported="archtoy.lazy")
    assert detail["line_number"] == 14


def test_graph_sees_kdaserve_lazy_import(graph):
    # kdaserve/__init__.py imports LLM inside its module __getattr__.
    assert graph.direct_import_exists(importer=ROOT, imported="kdaserve.entrypoints.llm")


def test_torch_cuda_detector():
    src = textwrap.dedent("""
        import torch
        import torch.cuda
        from torch.cuda import Stream
        from torch import cuda
        x = torch.cuda.is_available()
        y = torch.device("cpu")
        """)
    lines = [h.split(":")[1] for h in _torch_cuda_uses(src)]
    assert sorted(lines, key=int) == ["3", "4", "5", "6"]


def test_rule_table_covers_every_package(graph):
    packages = {_top(m) for m in graph.find_children(ROOT)}
    missing = sorted(packages - set(ALLOWED))
    assert not missing, f"add these top-level packages to ALLOWED: {missing}"
    unknown = sorted({dep for deps in ALLOWED.values() for dep in deps} - set(ALLOWED))
    assert not unknown, f"ALLOWED names packages it does not define: {unknown}"
    table_edges = {(pkg, dep): [] for pkg, deps in ALLOWED.items() for dep in deps}
    assert not _cycles(table_edges), f"ALLOWED itself has cycles: {_cycles(table_edges)}"


def test_no_import_cycles_between_packages(edges):
    cycles = _cycles(edges)
    lines = [f"{len(cycles)} import cycle(s) between packages:"]
    lines += ["  " + " -> ".join(cycle) for cycle in cycles]
    lines.append("made by these imports:")
    for a, b in sorted({hop for cycle in cycles for hop in zip(cycle, cycle[1:])}):
        lines.append(f"  {a} -> {b}:")
        lines += [f"    {imp}" for imp in edges[(a, b)]]
    assert not cycles, "\n".join(lines)


def test_dependency_rule(edges):
    lines = []
    for (src, dst), imports in sorted(edges.items()):
        if dst not in ALLOWED.get(src, set()):
            lines.append(f"{src} may not import {dst}:")
            lines += [f"    {imp}" for imp in imports]
    assert not lines, "dependency rule broken:\n" + "\n".join(lines)


def test_core_never_touches_torch_cuda():
    core = Path(kdaserve.__file__).parent / "core"
    if not core.is_dir():
        pytest.skip("no kdaserve/core")
    hits = []
    for path in sorted(core.rglob("*.py")):
        hits += _torch_cuda_uses(path.read_text(), str(path.relative_to(core.parent.parent)))
    assert not hits, "core/ must stay pure bookkeeping (no torch.cuda):\n" + "\n".join(hits)
