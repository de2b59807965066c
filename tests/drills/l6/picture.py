"""L6's picture: the page's worked example (content/l6.md §3, vLLM's [A, B, C, D, E]
comment): the learner's cascade_prefix_len on its block tables, then its cascade_attention,
one line per query token with the letters it sees (the shared prefix, read once, then its
own), the mean it should give and what it gave, and which known mistake gives the same
number. `picture` runs the learner's code and draws what it did (L6's tests save no case)."""
import torch
from rich.table import Table
from rich.text import Text

import _env
from _diagnose import said_error
from _paged import never_written
from _picture import plain, said

from .cases import EXAMPLE, example_case, example_tables
from .reference import prefix_len_rule

# (the reference's `mistake`, its words): a wrong number is put beside each that gives it.
MISTAKES = (("prefix_causal", "pass 1 causal (pitfall:prefix_causal)"),
            ("prefix_twice", "prefix counted twice (pitfall:suffix_not_offset)"),
            ("swapped", "merge sides swapped (pitfall:merge_swapped)"),
            ("no_prefix", "the suffix's part alone"), ("no_suffix", "the prefix's part alone"))


def _mark(ok):
    return Text("✓", style="green") if ok else Text("✗", style="bold red")


def draw_prefix_len(module, console):
    """cascade_prefix_len on the example's tables, block_size 1 and 2, against the rule."""
    console.print(Text.assemble(("your cascade_prefix_len", "bold"), " on the example (request 1 [A B C D E X], 3 "
                                "cached; request 2 [A B C D E Y], 4 cached; full blocks of the same letters shared):"))
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("block_size", "block_table", "shared columns", "min cached", "expected", "yours", ""):
        table.add_column(column)
    for block_size in (1, 2):
        case = example_case(block_size, _env.DEVICE)
        args = (case.block_table, case.query_start_loc, case.seq_lens, block_size)
        want = prefix_len_rule(*args)
        shared = prefix_len_rule(*args, cap=False) // block_size
        try:
            got = module.cascade_prefix_len(*args)
            yours, ok = Text(repr(got)), type(got) is int and got == want
        except Exception as error:  # the picture must draw whatever the learner's code does
            yours, ok = said("raised ", said_error(error)), False
        table.add_row(str(block_size), str(example_tables(block_size)[0].tolist()), str(shared),
                      str(min(EXAMPLE["computed"])), str(want), yours, _mark(ok))
    console.print(table)


def draw_attention(case, got, console):
    """cascade_attention's output on the example (block_size 1, one head, D = 1, q = k = 1:
    each output is the mean of the values its query sees) against the mean."""
    want = case.reference()[:, 0, 0].tolist()
    models = {name: case.reference(mistake=name)[:, 0, 0].tolist() for name, _ in MISTAKES}
    prefix = case.common_prefix_len
    console.print(f"\n[bold]your cascade_attention[/] with common_prefix_len {prefix}: pass 1 reads "
                  f"{' '.join(EXAMPLE['tokens'][0][:prefix])} once for every query, unmasked; pass 2 each query's own "
                  f"keys after them, causally; V holds " + " ".join(f"{k}={v:g}" for k, v in EXAMPLE["values"].items()))
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("request", "query", "position", "keys it sees", "expected", "yours", "", "the same number as"):
        table.add_column(column)
    unwritten = never_written(got.cpu())[:, 0, 0].tolist()
    for t, (b, _, pos) in enumerate(case.rows()):
        letters = EXAMPLE["tokens"][b]
        sees = " ".join(letters[:prefix]) + " | " + " ".join(letters[prefix:pos + 1])
        value = float(got[t, 0, 0])
        ok = abs(value - want[t]) <= 1e-4
        fits = [] if ok else [words for name, words in MISTAKES if abs(value - models[name][t]) <= 1e-4]
        mark = Text("·", style="bold white on red") if unwritten[t] else _mark(ok)
        table.add_row(str(b + 1), letters[pos], str(pos), sees, f"{want[t]:.4g}",
                      "never written" if unwritten[t] else plain(f"{value:.4g}"), mark,
                      Text(", ".join(fits), style="yellow"))
    console.print(table)
    console.print("[dim]keys: the shared prefix | the request's own; ✓ right   ✗ wrong   · never written[/]")


def picture(module, console):
    """Your cascade_prefix_len and cascade_attention on the page's example."""
    draw_prefix_len(module, console)
    case = example_case(1, _env.DEVICE)
    try:
        module.cascade_attention(*case.args(), **case.kwargs())
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said("cascade_attention raised ", said_error(error)))
    draw_attention(case, case.out.view, console)
