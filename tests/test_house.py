"""The shape of the house (README, "Adding a drill"): the imports under tests/ form no
cycle, the shared layer imports no drill and no manifest, every drill folder has the
same parts, no module grows past what a reader takes in, and the trees import nothing
of the machinery. Read from the source (every import, at any depth), not by running it.
"""
import ast
from pathlib import Path

import pytest

from _manifest import DRILLS
from _tree import ROOT

pytestmark = pytest.mark.meta

TESTS = ROOT / "tests"
# The front reads the manifest and wires the drills to the machinery; everything else
# under tests/ that starts with an underscore is the shared layer and names no drill.
FRONT = {"_manifest", "_plugin", "_entry"}
# The parts of a drill folder, the same names in every drill: a drill without a picture
# or a traffic case has no file for it (never an empty one).
PARTS = {"__init__", "cases", "reference", "checks", "mistakes", "bench", "page"}
OPTIONAL_PARTS = {"traffic", "picture"}
MAX_LINES, MAX_FRONT_LINES = 450, 220


def module_name(path):
    rel = path.relative_to(TESTS).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules():
    """{module name: path} of every module under tests/, and grader.py as 'grader'."""
    found = {module_name(p): p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    found["grader"] = ROOT / "grader.py"
    return found


def imports_of(name, path, known):
    """The known modules `name` imports, anywhere in its file (late imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if package else []
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v), on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def is_shared(name):
    return name.startswith("_") and name not in FRONT


def is_drill(name):
    return name == "drills" or name.startswith("drills.")


def test_the_imports_form_no_cycle():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_finder_sees_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_shared_layer_imports_no_drill_and_no_front():
    bad = {name: sorted(t for t in targets if is_drill(t) or t in FRONT or t == "grader" or t.startswith("test_"))
           for name, targets in graph().items() if is_shared(name)}
    bad = {name: targets for name, targets in bad.items() if targets}
    assert not bad, f"shared modules reaching up: {bad}"


def test_a_drill_folder_reaches_only_down():
    """A drill's parts import the shared layer (and, for a reference they build on, another
    drill's parts), never the manifest, the front or a test file; no part imports its
    own folder's __init__ (the entry it is part of)."""
    bad = {}
    for name, targets in graph().items():
        if not is_drill(name) or name.count(".") < 2:
            continue
        entry = name.rpartition(".")[0]
        wrong = sorted(t for t in targets if t in FRONT or t == "grader" or t.startswith("test_") or t == entry)
        if wrong:
            bad[name] = wrong
    assert not bad, f"drill parts reaching up: {bad}"


def test_every_drill_folder_has_the_same_parts():
    folders = {p.name: p for p in (TESTS / "drills").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert sorted(folders) == sorted(d.id for d in DRILLS), "tests/drills/ holds one folder per drill of the manifest"
    assert not [p for p in (TESTS / "drills").glob("*.py") if p.name != "__init__.py"], "drills are folders now"
    for drill_id, folder in folders.items():
        parts = {p.stem for p in folder.glob("*.py")}
        assert PARTS <= parts, f"tests/drills/{drill_id}/ lacks {sorted(PARTS - parts)}"
        assert parts <= PARTS | OPTIONAL_PARTS, f"tests/drills/{drill_id}/ has parts of no known name: " \
                                                f"{sorted(parts - PARTS - OPTIONAL_PARTS)}"
        for part in parts:
            text = (folder / f"{part}.py").read_text()
            assert ast.get_docstring(ast.parse(text)), f"tests/drills/{drill_id}/{part}.py says in a docstring what it holds"


def test_no_module_is_longer_than_a_reader_takes_in():
    long = {str(p.relative_to(ROOT)): n for name, p in modules().items()
            if (n := len(p.read_text().splitlines())) > (MAX_FRONT_LINES if name == "grader" else MAX_LINES)}
    assert not long, f"over {MAX_LINES} lines (grader.py: {MAX_FRONT_LINES}): {long}"


@pytest.mark.parametrize("tree", ["mine", "solutions"])
def test_the_trees_import_nothing_of_the_machinery_or_each_other(tree):
    stems = {d.stem for d in DRILLS}
    for path in (ROOT / tree).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                top = n.split(".")[0]
                assert not (top.startswith("_") or top in ("drills", "grader", "tests") or top in stems
                            or getattr(node, "level", 0)), f"{tree}/{path.name} imports {n!r}"


def _jit(decorator):
    """@triton.jit, @jit, or either called with options."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "jit") or (isinstance(target, ast.Name)
                                                                             and target.id == "jit")


def _kernel_readable_globals(module):
    """Module-level names a kernel may read when Triton compiles it for a GPU: imports,
    other kernels, and values wrapped in tl.constexpr (by the source, not by importing it)."""
    ok = set()
    for node in module.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            ok |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef) and any(_jit(d) for d in node.decorator_list):
            ok.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                ok |= {t.id for t, v in pairs if isinstance(t, ast.Name) and isinstance(v, ast.Call)
                       and getattr(v.func, "attr", getattr(v.func, "id", None)) == "constexpr"}
    return ok


@pytest.mark.parametrize("drill", DRILLS, ids=lambda d: d.id)
def test_reference_kernels_read_only_constexpr_globals(drill):
    """Triton compiling for a GPU lets a kernel read a module-level name only if it is a
    tl.constexpr, a module or another kernel; the CPU interpreter never checks, so a
    reference could pass every test here and fail on every GPU (L7's LN2 once did)."""
    source = ast.parse((ROOT / "solutions" / f"{drill.stem}.py").read_text())
    assigned = {t.id for node in source.body if isinstance(node, ast.Assign) for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(t, ast.Name)}
    assigned |= {node.name for node in source.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    readable = _kernel_readable_globals(source)
    for kernel in [n for n in source.body if isinstance(n, ast.FunctionDef) and any(_jit(d) for d in n.decorator_list)]:
        own = {a.arg for a in kernel.args.args} | {n.id for n in ast.walk(kernel)
                                                   if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        read = {n.id: n.lineno for n in ast.walk(kernel) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        bad = {name: line for name, line in read.items() if name in assigned - readable - own}
        assert not bad, (f"solutions/{drill.stem}.py: kernel {kernel.name} reads module globals {bad} (name: line) "
                         f"that are not tl.constexpr: a GPU compile refuses them; wrap them in tl.constexpr(...)")
