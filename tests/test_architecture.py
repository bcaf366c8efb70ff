"""The package's shape: floors whose imports only point down, no import cycles, no private names
across modules, no `models` import, and the engine reads no parallel config section (the plan
does, once)."""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

from tests.helpers import REPO

PKG = os.path.join(REPO, "jax_overlap")
MODELS = os.path.join(REPO, "models")


def _modules(roots=(PKG,)) -> dict[str, str]:
    """Dotted module name -> source path, for every module under `roots`."""
    out = {}
    for top in roots:
        for root, _, files in os.walk(top):
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
CONFIG_READERS = {"jax_overlap/config.py", "jax_overlap/config_validate.py",
                  "jax_overlap/plan/derived.py", "jax_overlap/plan/memory.py",
                  "jax_overlap/plan/schedule.py", "jax_overlap/plan/comm.py",
                  "jax_overlap/plan/parallel_plan.py", "jax_overlap/cli.py",
                  "jax_overlap/training/loop.py",
                  # the tuner: its candidate configs, and the hosts it splits dp over
                  "jax_overlap/analysis/tune/candidates.py", "jax_overlap/analysis/tune/search.py",
                  "jax_overlap/analysis/tune/slow_search.py",
                  # `build_facts`: the plain numbers a model builder may ask for (tp, units)
                  "jax_overlap/model_api.py"}
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


# ------------------------------------------------------------------------------------ floors

# Lowest first; a module may import its own floor's modules and those below, never above. A
# name is a subpackage (`jax_overlap.hardware`) or a top-level module (`jax_overlap.config`);
# `models` is the built-in models' package. docs/design/architecture.md draws the same floors.
FLOORS = [
    ["jax_overlap.errors", "jax_overlap.hardware"],  # the ConfigError; chips, links, memory
    ["jax_overlap.parallel"],  # mesh, collectives, collective matmul, partition
    ["jax_overlap.data", "jax_overlap.model_api"],  # token streams and shards; model contract
    ["models"],  # GPT, BERT, ResNet, Llama: per-device pure functions
    ["jax_overlap.overlap"],  # buckets, fsdp window, slow-axis strategies, XLA presets
    ["jax_overlap.pipeline"],  # schedules (pure) -> program -> executor
    ["jax_overlap.config", "jax_overlap.config_validate"],  # the typed config; its checks
    ["jax_overlap.plan", "jax_overlap.hf", "jax_overlap.resilience"],  # plan; HF I/O; storage
    ["jax_overlap.training"],  # step + guard/faults/rollback wrapper, loop, evaluate
    ["jax_overlap.analysis"],  # HLO, simulate, calibrate, tune, profile
    ["jax_overlap.cli", "jax_overlap"],  # the CLI; the package's __init__
]


def _floor(module: str) -> int | None:
    """The floor of a module of the package or of `models`; None for anything else."""
    best, floor = -1, None
    for n, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, floor = len(name), n
    return floor


def _upward_imports(modules: dict[str, str]) -> list[str]:
    bad = []
    for m, path in sorted(modules.items()):
        here = _floor(m)
        for target, name, line in _imports(path, modules):
            there = _floor(target)
            if here is not None and there is not None and there > here:
                bad.append(f"{os.path.relpath(path, REPO)}:{line} imports {target} "
                           f"(floor {there} over {here})")
    return bad


def test_every_module_has_a_floor():
    modules = _modules((PKG, MODELS))
    assert [m for m in modules if _floor(m) is None] == []
    assert _floor("jax_overlap") == len(FLOORS) - 1 and _floor("jax_overlap.config") == 6
    assert _floor("jax_overlap.hardware.memory") == 0 and _floor("models.gpt") == 3


def test_floor_check_sees_an_upward_import(tmp_path):
    low = tmp_path / "low.py"
    low.write_text("import os\nfrom jax_overlap.parallel import mesh\n"
                   "def f():\n    from jax_overlap.training import step\n")
    empty = tmp_path / "empty.py"
    empty.write_text("")
    modules = {"jax_overlap.hardware.low": str(low), "jax_overlap.parallel.mesh": str(empty),
               "jax_overlap.training.step": str(empty)}
    bad = _upward_imports(modules)
    assert len(bad) == 2 and all("low.py" in b for b in bad)
    assert ":2 imports jax_overlap.parallel.mesh (floor 1 over 0)" in bad[0]
    assert ":4 imports jax_overlap.training.step (floor 8 over 0)" in bad[1]


def test_imports_only_point_down():
    """Every import statement of the package and of `models/` (top level or inside a function)
    points to its own floor or a lower one."""
    assert _upward_imports(_modules((PKG, MODELS))) == []


# Chains of modules, lowest first: each imports only those before it.
ONE_WAY_CHAINS = {
    # reads and writes at a slot -> F, B, W branches -> the scans -> the per-device step
    "executor": ["pipeline.slots", "pipeline.actions", "pipeline.tick_loop", "pipeline.executor"],
    # tick timing -> the table -> the list scheduler -> the named schedules -> paired tables
    # -> make_schedule
    "schedules": ["pipeline.ticks", "pipeline.table", "pipeline.list_scheduler",
                  "pipeline.generators", "pipeline.pairing", "pipeline.schedules"],
    # plain values -> what the config alone gives -> what fits -> the pipeline's and the
    # communication's knobs -> ParallelPlan.build
    "plan": ["plan.values", "plan.derived", "plan.memory", "plan.schedule", "plan.comm",
             "plan.parallel_plan"],
}


@pytest.mark.parametrize("chain", sorted(ONE_WAY_CHAINS))
def test_module_chains_import_one_way(chain):
    """No module of a chain (the executor's, the schedule builders', the plan's) reaches up
    it."""
    modules = _modules()
    names = [f"jax_overlap.{n}" for n in ONE_WAY_CHAINS[chain]]
    bad = [f"{name} imports {target}" for i, name in enumerate(names)
           for target, _, _ in _imports(modules[name], modules)
           if target in names and names.index(target) >= i]
    assert bad == []


def test_models_read_no_parallel_config_section():
    """A model takes `cfg.model` and the plain facts `model_api.build_facts` hands its builder;
    the mesh, pipeline and overlap sections are the plan's."""
    bad = {os.path.relpath(p, REPO): r for p in _modules((MODELS,)).values()
           if (r := _section_reads(p))}
    assert bad == {}


# Who builds a `ParallelPlan`: `training/assemble.py` (every run, and `plan_for` for the tools
# that only price or check a plan) and the tuner's candidate loop. Everything else assembles.
PLAN_BUILDERS = {"jax_overlap/training/assemble.py", "jax_overlap/analysis/tune/candidates.py"}


def _plan_builds(path: str) -> list[int]:
    """Lines of `ParallelPlan.build(...)` calls (also as `plan_lib.ParallelPlan.build`)."""
    return [node.lineno for node in ast.walk(ast.parse(open(path).read()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "build"
            and (getattr(node.func.value, "id", None) == "ParallelPlan"
                 or getattr(node.func.value, "attr", None) == "ParallelPlan")]


def test_plans_are_built_only_by_assemble_and_the_tuner(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("a = ParallelPlan.build(cfg)\nb = plan_lib.ParallelPlan.build(cfg, m)\n"
                     "c = Other.build(cfg)\n")
    assert _plan_builds(str(probe)) == [1, 2]
    # The library, the benches and the tests; the plan's own tests build plans directly.
    paths = list(_modules().values()) + glob.glob(os.path.join(REPO, "bench", "*.py")) + [
        p for p in glob.glob(os.path.join(REPO, "tests", "**", "*.py"), recursive=True)
        if os.path.basename(p) != "test_plan.py"]
    bad = {}
    for path in paths:
        rel = os.path.relpath(path, REPO).replace(os.sep, "/")
        if rel not in PLAN_BUILDERS and (calls := _plan_builds(path)):
            bad[rel] = calls
    assert bad == {}
