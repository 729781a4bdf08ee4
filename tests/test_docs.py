"""The docs stay true to the code and stay reference.

* Every name ``docs/design.md`` puts in backticks as code still exists:
  - a dotted name that starts with ``lockgate.`` resolves fully (import the longest module prefix,
    then ``getattr`` the rest);
  - another dotted or slashed name (``engine.core``, ``core.EngineCore``, ``EngineCore.add_request``,
    ``layers/forms.packed_forms``) whose first part is a lockgate module or a name defined at the top
    of a lockgate module resolves through at least one of them (``lockgate.`` prefixed, a module whose
    dotted path ends with that part, or a module that defines that name);
  - a dotted name whose first part is a CamelCase name that lockgate does not define, and is not a
    known outside name (``Tensor.to``), fails: it names a class that no longer exists;
  - a bare ``name()`` or a bare CamelCase name must be defined somewhere in the package (a class, a
    function or method, or a module-level assignment), a builtin, or a known outside name;
  - a file path (``ipc/child.py``, ``kernels/csrc/steal.h``, ``tests/test_layers.py``) exists.
  An attribute ``getattr`` cannot see on a class (an instance attribute) counts when some class of its
  MRO assigns ``self.<name>`` or declares it as an annotated field. Lowercase first parts that are not
  lockgate's (``x.to``, ``gc.freeze``) are variables or other libraries and are not checked.
* README.md is a user guide of at most 300 lines, docs/performance.md a reference of at most 500.
* No tracked file under lockgate/, benchmarks/, docs/ or README.md says "round N": the history of how a
  figure was reached is in git, not in the docs or comments.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lockgate"
DESIGN = ROOT / "docs" / "design.md"

# Names of other libraries (and of C++ / CPU things) that design.md puts in backticks as code.
EXTERNAL = {"Tensor", "GGUFReader", "BadRequestError", "Authorization"}
FILE_SUFFIXES = (".py", ".cpp", ".h")
DATA_SUFFIXES = (".json", ".safetensors", ".gguf", ".md", ".toml", ".txt", ".sh", ".so", ".yaml", ".yml")
IDENT = r"[A-Za-z_]\w*"
NAME_RE = re.compile(rf"^{IDENT}(?:[./]{IDENT})*$")
CALL_RE = re.compile(r"^(?P<name>[\w./]+?)\((?P<args>.*)\)$")


# ---- what the package defines ----------------------------------------------------------------
@functools.cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module and package of lockgate (read from disk, no import)."""
    out: dict[str, Path] = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


@functools.cache
def definitions() -> tuple[dict[str, set[str]], set[str]]:
    """(top-level name -> modules defining it, every class / function / method / assigned name anywhere)."""
    top: dict[str, set[str]] = {}
    anywhere: set[str] = set()
    for mod, f in modules().items():
        tree = ast.parse(f.read_text(), str(f))
        for node in tree.body:
            for name in _bound_names(node):
                top.setdefault(name, set()).add(mod)
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                anywhere.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                anywhere.update(_bound_names(node))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                anywhere.update((a.asname or a.name).split(".")[0] for a in node.names)
    for src in (PKG / "kernels" / "csrc").glob("*.[ch]*"):  # the C++ kernels' functions and ops
        anywhere.update(re.findall(rf"\b({IDENT})\s*\(", src.read_text()))
    return top, anywhere


def _bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.ImportFrom):
        return [a.asname or a.name for a in node.names]
    return []


# ---- resolving one name ----------------------------------------------------------------------
def _declared_on(cls: type, attr: str) -> bool:
    """An instance attribute: some class of ``cls``'s MRO assigns ``self.<attr>`` or declares it as a field."""
    import inspect

    for klass in inspect.getmro(cls):
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        tree = ast.parse(_dedent(src))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name) \
                    and node.value.id == "self" and isinstance(node.ctx, ast.Store):
                return True
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
                return True
        slots = getattr(klass, "__slots__", ())
        if attr in (slots if isinstance(slots, (tuple, list)) else (slots,)):
            return True
    return False


def _dedent(src: str) -> str:
    import textwrap

    return textwrap.dedent(src)


def resolves(dotted: str) -> bool:
    """Import the longest prefix of ``dotted`` that is a lockgate module, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        mod_name = ".".join(parts[:cut])
        if mod_name not in modules():
            continue
        obj: object = importlib.import_module(mod_name)
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and _declared_on(obj, attr):
                obj = None  # an instance attribute: nothing further can be checked
                break
            else:
                sub = f"{getattr(obj, '__name__', '')}.{attr}"
                if sub in modules():
                    obj = importlib.import_module(sub)
                    continue
                return False
        return True
    return False


def candidates(name: str) -> list[str]:
    """Fully qualified spellings a name of design.md may mean (empty: not a lockgate name)."""
    if name.startswith("lockgate."):
        return [name]
    first, _, rest = name.partition(".")
    top, _ = definitions()
    out = []
    if f"lockgate.{first}" in modules():
        out.append(f"lockgate.{name}")
    for mod in modules():
        if mod.endswith(f".{first}") and mod != f"lockgate.{first}":
            out.append(f"{mod}.{rest}" if rest else mod)
    for mod in sorted(top.get(first, ())):
        out.append(f"{mod}.{name}")
    return out


def file_exists(path: str) -> bool:
    if "/" in path:
        return any((base / path).exists() for base in (ROOT, PKG))
    return any(p.is_file() for base in (PKG, ROOT / "benchmarks", ROOT / "tests") for p in base.rglob(path))


def problem(token: str) -> str | None:
    """Why a backticked token of design.md names nothing that exists, or None."""
    m = CALL_RE.match(token)
    called = m is not None
    name = m.group("name") if m else token
    if name.endswith(FILE_SUFFIXES) and re.fullmatch(r"[\w./]+", name):
        return None if file_exists(name) else "no such file"
    if name.endswith(DATA_SUFFIXES) or not NAME_RE.match(name):
        return None
    if "/" in name and file_exists(name):  # a directory
        return None
    if "/" in name:
        path, _, attrs = name.rpartition("/")
        mod_file, _, attrs = attrs.partition(".")
        outside = ROOT / path / f"{mod_file}.py"
        if outside.is_file() and not (ROOT / path).is_relative_to(PKG) and path.split("/")[0] != "lockgate":
            defined = {n for node in ast.parse(outside.read_text()).body for n in _bound_names(node)}
            return None if attrs.split(".")[0] in defined else f"{path}/{mod_file}.py defines no {attrs}"
        name = name.replace("/", ".")
    if "." not in name:
        _, anywhere = definitions()
        if called or re.match(r"^[A-Z][a-z]", name):
            if name in anywhere or name in EXTERNAL or hasattr(builtins, name):
                return None
            return "defined nowhere in lockgate"
        return None
    options = candidates(name)
    if options:
        return None if any(resolves(o) for o in options) else f"does not resolve (tried {', '.join(options)})"
    first = name.split(".")[0]
    if re.match(r"^[A-Z][a-z]", first) and first not in EXTERNAL:
        return f"{first} is defined nowhere in lockgate"
    return None


def design_tokens() -> list[tuple[int, str]]:
    out = []
    in_fence = False
    for lineno, line in enumerate(DESIGN.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        out.extend((lineno, t) for t in re.findall(r"`([^`\n]+)`", line))
    return out


def test_every_name_in_the_design_notes_exists() -> None:
    bad = [f"docs/design.md:{n}: `{t}`: {why}" for n, t in design_tokens() if (why := problem(t))]
    assert not bad, "names in docs/design.md that the code no longer has:\n" + "\n".join(bad)


@pytest.mark.parametrize("token", ["peak_estimate()", "LlamaModel.fused_ops", "LlamaArgs.lora_targets()",
                                   "lockgate.runner.no_such_module", "EngineCore.no_such_method",
                                   "core.NoSuchThing", "runner/no_such_file.py"])
def test_the_check_catches_a_name_that_does_not_exist(token: str) -> None:
    assert problem(token) is not None


@pytest.mark.parametrize("token", ["lockgate.runner.tuning_attention", "core.EngineCore", "EngineCore.add_request",
                                   "layers/forms.packed_forms", "ipc/child.py", "check_invariants()",
                                   "ModelRunner._logits_buffer", "x.to(float32)", "config.json", "--dtype auto"])
def test_the_check_passes_names_that_exist_and_leaves_other_text_alone(token: str) -> None:
    assert problem(token) is None


# ---- size and tone ---------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "limit"), [("README.md", 300), ("docs/performance.md", 500)])
def test_the_guide_and_the_performance_reference_stay_short(path: str, limit: int) -> None:
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= limit, f"{path} has {lines} lines; at most {limit} (detail goes into docs/, history into git)"


def tracked_files() -> list[Path]:
    """The repository's files under lockgate/, benchmarks/, docs/ and README.md: tracked or new, not ignored."""
    where = ["lockgate", "benchmarks", "docs", "README.md"]
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *where],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        files = [ROOT / p for p in listed]
    except (OSError, subprocess.CalledProcessError):
        files = [ROOT / "README.md", *(p for w in where[:3] for p in (ROOT / w).rglob("*"))]
    return [f for f in files if f.is_file() and "__pycache__" not in f.parts]


def test_no_file_tells_the_history_in_rounds() -> None:
    pattern = re.compile(r"\bround \d+\b", re.IGNORECASE)
    found = []
    for f in tracked_files():
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{f.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not found, "state the fact, not the round it came from:\n" + "\n".join(found)
