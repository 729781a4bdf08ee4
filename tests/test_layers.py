"""The package's layering, checked: no lower layer imports a higher one, and the torch-free parts stay
torch-free (docs/design.md, "Layers").

Every ``import`` in every module is read with ``ast`` (those inside functions too: a lazy import is
still a dependency), so a new edge that breaks the order fails here, not in review.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lockgate"

# Rank of each top-level unit of the package; a unit may import its own and lower-ranked units only.
LAYERS: dict[str, int] = {
    "sampling": 0, "plan": 0, "kernel_choice": 0, "version": 0, "paths": 0, "progress": 0,
    "config": 1, "jsonsafe": 1,
    "vllm_compat": 2, "kvcache": 2, "ipc": 2, "httpguard": 2, "httpserver": 2, "kernels": 2, "checkpoint": 2,
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
TORCH_FREE = ["lockgate.config", "lockgate.paths", "lockgate.progress", "lockgate.sampling", "lockgate.plan", "lockgate.kernel_choice",
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
