"""Checks of the repository itself: every drill has its four files, every stub in
mine/ still raises NotImplementedError, stubs and solutions expose the same
names and signatures, stub docstrings state the contract and not the recipe, and
the trees import nothing from tests/ or each other."""
import ast
import inspect
import re
import subprocess

import pytest

from _manifest import DRILLS
from _tree import ROOT, load_drill

STEMS = [d.stem for d in DRILLS]


def _public_names(tree, stem):
    source = (ROOT / tree / f"{stem}.py").read_text()
    return {n.name for n in ast.parse(source).body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def _python_function(obj):
    return getattr(obj, "fn", obj)  # a @triton.jit kernel wraps its Python function


@pytest.mark.parametrize("drill", DRILLS, ids=lambda d: d.id)
def test_every_drill_has_its_four_files(drill):
    for path in drill.files:
        assert (ROOT / path).is_file(), f"{drill.id}: {path} is missing"


@pytest.mark.parametrize("drill", DRILLS, ids=lambda d: d.id)
def test_api_in_the_manifest_is_what_the_files_define(drill):
    for tree in ("mine", "solutions"):
        assert _public_names(tree, drill.stem) == set(drill.api), f"{tree}/{drill.stem}.py"


@pytest.mark.parametrize("stem", STEMS)
def test_stub_and_solution_have_the_same_signatures_and_docstrings(stem):
    mine, solution = load_drill("mine", stem), load_drill("solutions", stem)
    for name in _public_names("solutions", stem):
        a, b = _python_function(getattr(mine, name)), _python_function(getattr(solution, name))
        assert inspect.signature(a) == inspect.signature(b), f"{name}: signatures differ"
        assert a.__doc__, f"mine/{stem}.py: {name} needs a docstring telling the learner what to do"


def _edited_by_learner(path):
    """True when git says the file differs from the committed one (a learner's work)."""
    result = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(path)], cwd=ROOT, capture_output=True)
    return result.returncode == 1


@pytest.mark.parametrize("stem", STEMS)
def test_every_stub_raises_not_implemented(stem):
    path = ROOT / "mine" / f"{stem}.py"
    if _edited_by_learner(path):
        pytest.skip(f"{path.name} holds your work; this check is for the pristine stubs")
    mine = load_drill("mine", stem)
    for name in _public_names("mine", stem):
        fn = _python_function(getattr(mine, name))
        # Keyword-only parameters (E1's generate) have defaults and are not passed positionally.
        args = [None] * sum(p.kind != p.KEYWORD_ONLY for p in inspect.signature(fn).parameters.values())
        with pytest.raises(NotImplementedError, match=r"content/\w+\.md §\d+"):
            fn(*args)
    source = path.read_text()
    assert source.count("TODO(") >= len(_public_names("mine", stem)), "each stub function needs a TODO"


@pytest.mark.parametrize("tree", ["mine", "solutions"])
def test_trees_import_nothing_from_tests_or_each_other(tree):
    # importlib and sys: E1's engine loads L1 and L3 from its own folder by path (never by name);
    # weakref: it keeps a model's cache and graphs no longer than the model.
    allowed = {"torch", "triton", "math", "os", "typing", "functools", "importlib", "sys", "weakref"}
    for path in (ROOT / tree).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.relative_to(ROOT)} imports {name}"


# ---------------------------------------------------------------------------
# A stub tells the contract, not the recipe (issue 37): its docstrings name no Triton
# call and no number the design contract does not.

RECIPE_WORDS = re.compile(r"\btl\.\w+|\btriton\.\w+|\bdiv_rn\b|\bprogram_id\b|\bgdc_\w+|\bexp2\b|\blog2\b|\bgrid\b|"
                          r"\bnum_warps\b|\bnum_stages\b|\bconstexpr\b|\bprograms? per\b|\btiles?\b", re.I)
# The numbers the design contract states (ignoring license years and versions): slot -1,
# >= 1 and [B + 1], 2**31 elements, blocks of 16 and a budget of 256 tokens (E1's defaults),
# unified attention's 3-D path (L4), 4-D and 5-D caches (F1), fp8's largest finite values, E1's 1e-3.
CONTRACT_NUMBERS = {"0", "1", "2", "3", "4", "5", "16", "256", "448", "57344", "1e-3", "2**31"}  # and their negatives
NUMBER = re.compile(r"2\*\*31|2\^31|(?<![\w.§#])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w])")


def recipe_in_docstring(doc):
    """What a stub docstring says that the contract does not: Triton calls, launch words,
    numbers outside CONTRACT_NUMBERS. References (§5, §5.3, hint 6, an issue's #11584) are not numbers."""
    text = re.sub(r"§\d+(?:\.\d+)?|#\d+|\bhints? \d+", " ", doc or "")
    found = RECIPE_WORDS.findall(text)
    found += [n for n in NUMBER.findall(text) if n.lstrip("-") not in CONTRACT_NUMBERS]
    return found


def _docstrings(source):
    tree = ast.parse(source)
    yield "module", ast.get_docstring(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            yield node.name, ast.get_docstring(node)


@pytest.mark.parametrize("stem", STEMS)
def test_stub_docstrings_state_the_contract_not_the_recipe(stem):
    """Each docstring of mine/<stem>.py (module, functions, classes) names no Triton call,
    no launch word (grid, program_id, one program per, tile) and no number the design contract does not: the
    recipe lives in the page's hints and folded walkthrough."""
    source = (ROOT / "mine" / f"{stem}.py").read_text()
    told = {name: found for name, doc in _docstrings(source) if (found := recipe_in_docstring(doc))}
    assert not told, f"mine/{stem}.py docstrings give the recipe away: {told}"


def test_the_recipe_check_catches_a_planted_docstring():
    planted = '''"""One program per token (tl.program_id(0)): the quotient with tl.math.div_rn,
    clamped to +-480, in tiles of 64; grid (T,)."""'''
    found = recipe_in_docstring(ast.literal_eval(planted))
    assert {"tl.program_id", "tl.math", "div_rn", "-480", "64", "grid", "program per", "tiles"} <= set(found), found
    for contract in ("slot -1 is padding; offsets hold past 2**31 elements (content/l1.md §5).",
                     "saturated to +-448 (e4m3fn) or 57344 (e5m2); int32 or int64, fp32, float8_e4m3fn.",
                     "kv_indptr [B+1]: kv_indptr[0] = 0; a 5-D tensor; see content/l4.md §5.3 and triton-lang/triton#11584."):
        assert recipe_in_docstring(contract) == [], (contract, recipe_in_docstring(contract))


def test_reference_engines_decode_graphs_replay_the_eager_steps(monkeypatch):
    """The reference engine's CUDA-graph path (solutions/e1_paged_engine.py, DecodeGraphs),
    which only a GPU runs, checked here: a stand-in for the graph re-runs the step's
    forward on the buffers a capture records, so every replayed step reads what
    DecodeGraphs wrote into them. Through batches that shrink, padded rows, preemption
    and a second generate on the kept cache and graphs, the tokens are the eager engine's."""
    import torch
    from drills.e1.cases import tiny_model
    engine = load_drill("solutions", "e1_paged_engine")

    def capture(graphs, model, size):
        step = graphs._step(size)
        logits = engine._forward(model, graphs.caches, step, graphs.kernels).clone()

        def replay():
            logits.copy_(engine._forward(model, graphs.caches, step, graphs.kernels))
        return type("Graph", (), {"replay": staticmethod(replay)}), logits
    steps, frees, call, free = [], [], engine.DecodeGraphs.__call__, engine.BlockManager.free
    monkeypatch.setattr(engine, "_GRAPH_DEVICES", ("cpu",))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(engine.DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(engine.DecodeGraphs, "__call__", lambda g, m, b, batch: steps.append(len(batch)) or
                        call(g, m, b, batch))
    monkeypatch.setattr(engine.BlockManager, "free", lambda b, seq: frees.append(seq) or free(b, seq))
    model = tiny_model(seed=5)
    prompts = [[3, 9, 1], [7], [2, 2, 5, 8, 1, 4, 6], [11, 4], [5, 5, 5, 5, 5], [1, 30, 2]]
    new, args = [6, 3, 5, 7, 2, 6], dict(block_size=2, num_blocks=9, max_num_batched_tokens=8)
    eager = engine.generate(model, prompts, new, kernels=engine._tree_kernels(), **args)
    assert not steps
    frees.clear()
    assert engine.generate(model, prompts, new, **args) == eager
    replayed = list(steps)
    assert replayed and len(frees) > len(prompts), "the case must replay steps and preempt"
    graphs = engine._ENGINES[model][1]
    assert any(n not in graphs.sizes for n in replayed), "the case must pad a batch"
    assert engine.generate(model, prompts, new, **args) == eager  # the kept cache and graphs
    assert engine._ENGINES[model][1] is graphs
