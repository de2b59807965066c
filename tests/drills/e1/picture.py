"""E1's picture: the learner's engine on the page's worked example (content/e1.md §3: three
prompts of 5, 3 and 7 tokens, blocks of 4, 8 tokens a step) on a tiny random model: each
step as the page's schedule has it and as the engine ran it (query_start_loc, seq_lens,
the block tables), the first step that differs marked; then each request's new tokens
beside transformers' generate, the first that differs marked. `picture` runs the learner's
code and draws what it did (E1's tests save no case)."""
import os

from rich.table import Table
from rich.text import Text

from _diagnose import said_error
from _picture import plain, said

from .cases import Recorder, example_case, kernels_tree
from .checks import steps_of
from .reference import step_tensors


def _mark(ok):
    return Text("✓", style="green") if ok else Text("✗", style="bold red")


def draw_steps(case, steps, console):
    """The page's schedule beside the engine's steps (layer 0's L3 call of each)."""
    expected = case.schedule()
    console.print(Text.assemble(("each step", "bold"), " (the page's schedule, content/e1.md §3; yours, from your "
                                "engine's L3 calls at layer 0): ", case.describe()))
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("step", "rows (request: positions)", "query_start_loc, seq_lens", "yours", "", "your block tables"):
        table.add_column(column)
    first_wrong = None
    for s in range(max(len(expected), len(steps))):
        want = expected[s] if s < len(expected) else None
        rows = ", ".join(f"{r}: {a}..{a + n - 1}" for r, a, n in want["rows"]) if want else "(none: the page stops)"
        shown = str(step_tensors(want, case.block_size)[:2]) if want else ""
        yours = (steps[s][2], steps[s][3]) if s < len(steps) else None
        ok = want is not None and yours is not None and list(yours) == list(step_tensors(want, case.block_size)[:2])
        if not ok and first_wrong is None:
            first_wrong = s
        table.add_row(str(s), rows, shown, plain(yours) if yours else Text("(no step)", style="yellow"), _mark(ok),
                      plain(steps[s][4]) if s < len(steps) else "")
    console.print(table)
    console.print("[green]every step as the page schedules it[/]" if first_wrong is None else
                  "[yellow]your engine ran no step[/]" if not steps else
                  f"[bold red]the first step that differs: step {first_wrong}[/]")


def draw_tokens(case, got, console):
    """Each request's new tokens beside transformers' generate's."""
    want = case.reference()
    console.print("\n[bold]the new tokens[/], yours beside transformers' generate (greedy, each prompt alone):")
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("request", "prompt", "generate", "yours", ""):
        table.add_column(column)
    for r, (prompt, tokens) in enumerate(zip(case.prompts, want)):
        mine = got[r] if isinstance(got, list) and r < len(got) else None
        ok = mine == tokens
        j = None if ok or not isinstance(mine, list) else \
            next((j for j, (a, b) in enumerate(zip(mine, tokens)) if a != b), min(len(mine), len(tokens)))
        note = "" if j is None else f"  first differs at new token {j}"
        table.add_row(str(r), f"{len(prompt)} tokens", str(tokens), plain(mine) if mine is not None else "(none)",
                      Text.assemble(_mark(ok), (note, "yellow")))
    console.print(table)


def picture(module, console):
    """Your generate on the worked example, through a Recorder on the kernels it runs on."""
    case = example_case()
    tree = getattr(module, "_tree", None) or os.path.dirname(module.__file__)  # DRILLS_ISOLATE=0
    kernels = kernels_tree(tree)
    if kernels != tree and hasattr(module, "_worker"):
        module._worker.prepare(readable=[kernels])  # KERNELS=solutions: the worker reads that tree too
    rec, got = Recorder(kernels), None
    try:
        got = module.generate(case.model, case.prompts, case.max_new, **case.kwargs(), kernels=rec)
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said("generate raised ", said_error(error)))
    draw_steps(case, steps_of(case, rec.calls()), console)
    draw_tokens(case, got, console)
