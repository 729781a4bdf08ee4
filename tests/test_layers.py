"""The package's layering, checked: no lower layer imports a higher one, the torch-free parts stay
torch-free (docs/design.md, "Layers"), and no two modules import each other, directly or round a loop.

Every ``import`` in every module is read with ``ast`` (those inside functions too: a lazy import is
still a dependency), so a new edge that breaks the order fails here, not in review. The cycle check
reads the imports a module runs when it is imported (module level, class bodies, ``try``/``if``
blocks; not those under ``if TYPE_CHECKING:``, which never run, nor those inside functions, which
run once both modules are loaded: an entry function such as a tensor-parallel rank's ``main`` may
import the module that starts it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lockgate"

# Rank of each top-level unit of the package; a unit may import its own and lower-ranked units only.
LAYERS: dict[str, int] = {
    "sampling": 0, "plan": 0, "kernel_choice": 0, "version": 0, "paths": 0, "progress": 0,
    "config": 1, "jsonsafe": 1,
    "vllm_compat": 2, "server_config": 2, "kvcache": 2, "ipc": 2, "httpguard": 2, "httpserver": 2, "kernels": 2, "checkpoint": 2,
    "tokenizer": 3, "scheduler": 3, "layers": 3,
    "models": 4, "grammar": 4,
    "runner": 5,
    "engine": 6,
    "offline": 7, "server": 7, "gateway": 7, "bench": 7, "eval": 7,
    "fleet": 8, "cache_admin": 8,
    "cli": 9, "__init__": 9,
}
# Units whose modules must import without torch (torch is for the model: layers, models' architectures,
# runner, kernels). The entries are modules to import in a fresh interpreter.
TORCH_FREE = ["lockgate.config", "lockgate.server_config", "lockgate.paths", "lockgate.progress", "lockgate.sampling", "lockgate.plan", "lockgate.kernel_choice",
              "lockgate.kvcache.allocator", "lockgate.kvcache.radix", "lockgate.kvcache.kv_dtype", "lockgate.ipc.messages", "lockgate.ipc.channel",
              "lockgate.ipc.child", "lockgate.httpguard", "lockgate.tokenizer.tokenizer", "lockgate.tokenizer.output",
              "lockgate.tokenizer.process", "lockgate.scheduler.scheduler", "lockgate.scheduler.policy",
              "lockgate.scheduler.speculate", "lockgate.engine.core", "lockgate.engine.process",
              "lockgate.checkpoint.loader", "lockgate.grammar", "lockgate.grammar.sandbox", "lockgate.grammar.worker",
              "lockgate.jsonsafe", "lockgate.httpserver", "lockgate.checkpoint.peft", "lockgate.engine.grammar_wait", "lockgate.server.app", "lockgate.server.launch", "lockgate.gateway.proxy",
              "lockgate.gateway.command", "lockgate.bench.command", "lockgate.fleet.serve", "lockgate.fleet.ray_fleet", "lockgate.cli", "lockgate.vllm_compat"]


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "lockgate":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported lockgate module) for every import statement in the file."""
    here = "lockgate." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = here.rsplit(".", 1)[0] if path.name != "__init__.py" else here.removesuffix(".__init__")
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("lockgate")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.startswith("lockgate"):
                # "from lockgate import kernels" names a unit through its package
                names = [f"{mod}.{a.name}" for a in node.names] if mod == "lockgate" else [mod]
                out += [(node.lineno, n) for n in names]
    return out


def test_every_unit_has_a_layer() -> None:
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert units <= set(LAYERS), f"give these a layer in LAYERS: {sorted(units - set(LAYERS))}"


def test_no_lower_layer_imports_a_higher_one() -> None:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        unit = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for line, mod in imports_of(path):
            target = unit_of(mod)
            if target is None or target == unit:
                continue
            if target not in LAYERS:  # "from lockgate import SamplingParams" and the like: the package root
                target = "__init__"
            if LAYERS[target] >= LAYERS[unit] and not (target == "__init__" and unit == "__init__"):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({unit}, layer {LAYERS[unit]}) imports {mod} "
                           f"({target}, layer {LAYERS[target]})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_do_not_load_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"importing {module} loads torch\n{r.stderr[-2000:]}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_time_imports(path: Path, modules: set[str]) -> set[str]:
    """The lockgate modules ``path`` imports while it is being imported (see the module docstring).
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]

    def is_type_checking(node: ast.If) -> bool:
        t = node.test
        return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
            isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")

    def walk(body: list[ast.stmt]) -> Iterator[str]:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(node, ast.If) and is_type_checking(node):
                yield from walk(node.orelse)
                continue
            if isinstance(node, ast.Import):
                yield from (a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                yield from (f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names)
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for sub in getattr(node, field, None) or []:
                        yield from walk(getattr(sub, "body", None) if not isinstance(sub, ast.stmt) else [sub])

    return {m for m in walk(ast.parse(path.read_text(), str(path)).body) if m in modules and m != here}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (node -> nodes it points at) as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_no_import_cycles() -> None:
    paths = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph = {name: load_time_imports(path, set(paths)) for name, path in paths.items()}
    assert "lockgate.scheduler.ngram" in graph["lockgate.scheduler.request"]  # the walk sees imports at all
    assert "lockgate.scheduler.request" not in graph["lockgate.scheduler.speculate"]  # TYPE_CHECKING only
    cycle = find_cycle(graph)
    assert cycle is None, "these modules import each other: " + " -> ".join(cycle or [])
