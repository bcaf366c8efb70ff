"""The package's shape: no import cycles, no private names across modules, no `models` import,
and the engine reads no parallel config section (the plan does, once)."""

from __future__ import annotations

import ast
import os
import re

from tests.helpers import REPO

PKG = os.path.join(REPO, "jax_overlap")


def _modules() -> dict[str, str]:
    """Dotted module name -> source path, for every module of the package."""
    out = {}
    for root, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path: str, modules: dict[str, str]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import anywhere in the file,
    top-level or inside a function (a lazy import still ties the two modules together)."""
    tree = ast.parse(open(path).read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in modules:  # `from pkg import module`
                    out.append((sub, "", node.lineno))
                else:
                    out.append((node.module, a.name, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: set() for m in modules}
    for m, path in modules.items():
        for target, _, _ in _imports(path, modules):
            if target in modules and target != m:
                graph[m].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One representative cycle per strongly connected component of more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_private_names_across_modules():
    modules = _modules()
    bad = []
    for m, path in modules.items():
        for target, name, line in _imports(path, modules):
            if target.startswith("jax_overlap") and name.startswith("_") and target != m:
                bad.append(f"{os.path.relpath(path, REPO)}:{line} imports {target}.{name}")
    assert bad == []


def test_library_never_imports_models():
    modules = _modules()
    bad = [f"{os.path.relpath(path, REPO)}:{line} imports {target}"
           for m, path in modules.items() for target, _, line in _imports(path, modules)
           if target == "models" or target.startswith("models.")]
    assert bad == []


# Who may read the parallel sections of the config: the config itself, the plan that resolves
# them, the CLI, the training loop (which builds the plan) and the tuner (which writes candidate
# configs). Everything else takes the plan or plain values from it.
CONFIG_READERS = {"jax_overlap/config.py", "jax_overlap/plan.py", "jax_overlap/cli.py",
                  "jax_overlap/training/loop.py", "jax_overlap/analysis/tune.py"}
SECTION_READ = re.compile(r"\b(?:cfg|config)\.(?:mesh|pipeline|overlap)\b")


def _section_reads(path: str) -> list[str]:
    out = []
    for n, line in enumerate(open(path), 1):
        code = line.split("#", 1)[0]
        for m in SECTION_READ.finditer(code):
            out.append(f"{n}: {m.group(0)}")
    return out


def test_section_scan_sees_a_read():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("x = cfg.mesh.pp\ny = jax_overlap.pipeline.executor\nz = f(self.cfg.overlap)\n")
    assert _section_reads(f.name) == ["1: cfg.mesh", "3: cfg.overlap"]
    os.unlink(f.name)


def test_engine_does_not_read_parallel_config_sections():
    bad = {}
    for m, path in _modules().items():
        rel = os.path.relpath(path, REPO).replace(os.sep, "/")
        if rel not in CONFIG_READERS and (reads := _section_reads(path)):
            bad[rel] = reads
    assert bad == {}
