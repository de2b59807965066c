"""L4's picture: each sequence of a small batch cut into its chunks (their lengths, the
empty ones), each (sequence, query head) output right or wrong, and the learner's
merge_attention_states folding the chunks one by one, its first wrong merge marked.
`picture` runs the learner's code; `draw_case` draws a (case, output) pair that ran."""
import torch
from rich.table import Table
from rich.text import Text

import _env
from _diagnose import said_error
from _paged import owned_columns
from _picture import said

from .cases import split_case, spread_chunks
from .checks import _ALIGNS, _close
from .reference import TOLERANCE, chunk_bounds, chunk_states, merge_all, ref_merge

# One token, a sequence shorter than a tile, and one whose 4 chunks all hold tokens; so
# some chunks are empty however a kernel rounds them.
PICTURE_CASE = dict(seq_lens=[1, 40, 200], num_heads=2, num_kv_heads=1, head_size=8, block_size=16,
                    dtype=torch.float32, num_splits=4, seed=3)
SHOWN_ALIGN = 64  # the reference's TILE: chunks are ceil(n / num_splits) rounded up to 64 tokens


def _status(got, right):
    if not bool(torch.isfinite(got).all()):
        return Text("NaN", style="bold red")
    return Text("✓", style="green") if right else Text("✗", style="bold red")


def _fitting_prefix(case, b, got_b, atol, rtol):
    """(k, align): the first k chunks of sequence b, cut with some rounding, merged give
    its output on every head, while all of them do not; None when none fits."""
    scores, values = case.scores_values()[b]
    for align in [SHOWN_ALIGN, *sorted({*_ALIGNS, case.block_size} - {SHOWN_ALIGN})]:
        states = chunk_states(scores, values, chunk_bounds(scores.shape[1], case.num_splits, align))
        for k in range(1, len(states)):
            if all(states[j][1].isinf().all() for j in range(k, len(states))):
                break  # the rest are empty: the same answer as all of them
            if bool(_close(got_b, merge_all(states[:k])[0], atol, rtol).all()):
                return k, align
    return None


def draw_case(saved, console, merge=None):
    """(case, output): per sequence its chunks and outputs; with `merge` (the learner's
    merge_attention_states), each merge of the fold and the first that is wrong."""
    case, got = saved
    got = got.cpu().double()
    want = case.reference()
    atol, rtol = TOLERANCE[case.query.dtype]
    right = _close(got, want, atol, rtol)
    num_heads, splits = case.query.shape[1], case.num_splits
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    console.print(f"[dim]H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={case.query.shape[2]}, "
                  f"block_size={case.block_size}, num_splits={splits}; chunks as the reference cuts them: "
                  f"ceil(seq_len / num_splits) rounded up to {SHOWN_ALIGN} tokens, a chunk starting past seq_len "
                  f"is empty (content/l4.md §5)[/]")
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("seq", "seq_len", "blocks it owns", "chunks [start, end): length",
                   *(f"h{h}" for h in range(num_heads)), "your output fits"):
        table.add_column(column)
    folds = []
    for b, (scores, values) in enumerate(case.scores_values()):
        n = scores.shape[1]
        bounds = chunk_bounds(n, splits, SHOWN_ALIGN)
        chunks = Text()
        for i, (start, end) in enumerate(bounds):
            chunks.append(("  " if i else "") + (f"[{start},{end}): {end - start}" if end > start else "empty"),
                          style="" if end > start else "yellow")
        wrong = not bool(right[b].all())
        fit = ""
        if wrong and bool(torch.isfinite(got[b]).all()):
            found = _fitting_prefix(case, b, got[b], atol, rtol)
            fit = (f"chunks 0..{found[0] - 1} alone"
                   + ("" if found[1] == SHOWN_ALIGN else f" (chunks rounded to {found[1]})") + ", the rest not merged" if found
                   else "no prefix of the chunks")
        table.add_row(str(b), str(n), str(case.block_table[b].cpu()[owned[b]].tolist()), chunks,
                      *(_status(got[b, h], bool(right[b, h])) for h in range(num_heads)), Text(fit, style="yellow"))
        folds.append(chunk_states(scores, values, bounds))
    console.print(table)
    console.print("[dim]✓ right   ✗ wrong   NaN non-finite (or never written)[/]")
    if merge is not None:
        _draw_merges(folds, merge, console)


def _draw_merges(folds, merge, console):
    """The learner's merge_attention_states folding each sequence's chunks left to right,
    on the reference's chunk states (v, s); each merge against the float64 one."""
    console.print("\n[bold]your merge_attention_states[/], folding each sequence's chunks (v, s = their "
                  "log-sum-exp; empty: s = -inf, v garbage NaN) left to right:")
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("seq", "merge", "s_a", "s_b", "result", "expected s", "your s"):
        table.add_column(column)
    first_wrong = None
    for b, states in enumerate(folds):
        v, s = states[0][0], states[0][1]
        for i, (v_i, s_i, _) in enumerate(states[1:], start=1):
            v_b = torch.where(torch.isinf(s_i)[:, None], torch.full_like(v_i, float("nan")), v_i)
            v_a = torch.where(torch.isinf(s)[:, None], torch.full_like(v, float("nan")), v)
            want_v, want_s = ref_merge(v_a[None], s[None], v_b[None], s_i[None])
            args = (v_a[None].float(), s[None].float(), v_b[None].float(), s_i[None].float())
            try:
                got_v, got_s = merge(*(a.to(_env.DEVICE) for a in args))
                got_v, got_s = got_v.cpu().double(), got_s.cpu().double()
                ok = bool(_close(got_v, want_v, 1e-4, 1e-4).all()) and bool(
                    (torch.isclose(got_s, want_s, rtol=1e-6, atol=1e-5) | (torch.isinf(want_s) & (got_s == want_s)))
                    .all())
                shown = _status(got_v, ok)
                your_s = f"{float(got_s[0, 0]):.4g}"
            except NotImplementedError as error:
                console.print(said("", said_error(error), "yellow"))
                return
            except Exception as error:  # the picture must draw whatever the learner's code does
                console.print(said("merge_attention_states raised ", said_error(error)))
                return
            if not ok and first_wrong is None:
                first_wrong = (b, i)
                shown.append("  ← the first wrong merge", style="bold red")
            table.add_row(str(b), f"chunks 0..{i - 1} + chunk {i}", f"{float(s[0]):.4g}", f"{float(s_i[0]):.4g}",
                          shown, f"{float(want_s[0, 0]):.4g}", your_s)
            v, s = want_v[0], want_s[0]
    console.print(table)
    console.print("[green]every merge right[/]" if first_wrong is None else
                  f"[bold red]the first wrong merge: sequence {first_wrong[0]}, chunk {first_wrong[1]} merged into "
                  f"the chunks before it[/]")


def picture(module, console):
    """Your paged_decode_attention_split and merge_attention_states on PICTURE_CASE:
    sequences of 1, 40 and 200 tokens cut into 4 chunks."""
    case = spread_chunks(split_case(**PICTURE_CASE, device=_env.DEVICE))
    out = torch.full_like(case.query, float("nan"))
    try:
        module.paged_decode_attention_split(*case.args(), **case.kwargs(), out=out)
    except NotImplementedError as error:
        console.print(said("", said_error(error), "yellow"),
                      Text("the table shows the chunks it should cut, every output still unwritten", style="yellow"))
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said("paged_decode_attention_split raised ", said_error(error)))
    draw_case((case, out), console, merge=module.merge_attention_states)
