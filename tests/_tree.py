"""Which tree of drill modules runs: mine/ (default), solutions/, or any folder.

Tests reach a tree only through the `drill` fixture (tests/_plugin.py), which
hands them the module run in a worker process (tests/_worker.py, which loads it
with `load_drill` below); they never import mine/ or solutions/ directly.
"""
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED_TREES = {"mine": ROOT / "mine", "solutions": ROOT / "solutions"}


def default_tree():
    return os.environ.get("DRILLS_TREE", "mine")


def tree_path(tree):
    """'mine', 'solutions' or a path to a folder holding the same module files."""
    path = NAMED_TREES.get(tree) or Path(tree).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"tree {tree!r}: {path} is not a folder (use mine, solutions or a path)")
    return path


def worker_trees(tree, *more):
    """The folders a worker serving `tree` may read, resolved: `tree`, `more`, and the tree
    E1's kernels come from when DRILLS_KERNELS names one (make grade KERNELS=). The `drill`
    fixture and the grade's plan for it (tests/_grading.py) ask here alike."""
    kernels = [os.environ["DRILLS_KERNELS"]] if os.environ.get("DRILLS_KERNELS") else []
    return sorted({str(tree_path(t)) for t in (tree, *more, *kernels)})


def load_drill(tree, stem):
    """Import <tree>/<stem>.py under a name unique to that folder.

    A unique name lets one process hold the same drill from two trees (the
    meta-tests compare mine/ with solutions/).
    """
    path = tree_path(tree) / f"{stem}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    tag = hashlib.sha1(str(path.parent).encode()).hexdigest()[:8]
    name = f"drills_tree_{tag}_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton looks kernels' globals up through the module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def parameters(stem):
    """{function: its parameter names, in order} of the reference solutions/<stem>.py
    (read from the source, not imported: the test process runs no tree's code)."""
    import ast
    tree = ast.parse((ROOT / "solutions" / f"{stem}.py").read_text())
    return {node.name: tuple(a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs)
            for node in tree.body if isinstance(node, ast.FunctionDef)}


def load_front():
    """grader.py as a module (its commands called in process, by the tests)."""
    spec = importlib.util.spec_from_file_location("drills_grader_front", ROOT / "grader.py")
    front = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(front)
    return front
