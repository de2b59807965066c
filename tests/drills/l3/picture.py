"""L3's picture: for each sequence of a small mixed batch, the causal mask over its
prefix + chunk (one row per query token, one column per key, grouped by the physical
block that holds it), each row's outputs marked right or wrong, and for a wrong row
the window of keys its output does fit, when one does. `picture` runs the learner's
kernel on that batch; `draw_case` draws a (case, output) pair that already ran."""
import math

import torch
from rich.text import Text

import _env
from _diagnose import said_error
from _paged import never_written, owned_columns
from _picture import said

from .cases import paged_prefill_case
from .reference import TOLERANCE

# A chunk over a prefix that ends mid-block, a pure prefill, and a decode row; blocks of 4.
PICTURE_CASE = dict(q_lens=[4, 3, 1], context_lens=[5, 0, 6], num_heads=2, num_kv_heads=1, head_size=8,
                    block_size=4, dtype=torch.float32, tail="nan", seed=3)


def _keys(case, b):
    """Sequence b's keys and values in position order, float64 on the CPU: [n, H_kv, D] each."""
    n, bs = int(case.seq_lens[b]), case.block_size
    blocks = case.block_table[b, :math.ceil(n / bs)].long().cpu()
    k, v = (c.cpu()[blocks].double().flatten(0, 1)[:n] for c in (case.k_cache, case.v_cache))
    return k, v


def _window(case, t, k, v, lo, hi):
    """Token t's attention over keys lo..hi of its sequence, every query head: [H_q, D]."""
    num_heads, head_size = case.query.shape[1:]
    group = num_heads // case.k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if case.scale is None else case.scale
    q = case.query[t].cpu().double()
    kk, vv = k[lo:hi + 1][:, torch.arange(num_heads) // group], v[lo:hi + 1][:, torch.arange(num_heads) // group]
    p = (torch.einsum("hd,khd->hk", q, kk) * scale).softmax(-1)
    return torch.einsum("hk,khd->hd", p, vv)


def _fitted_window(case, t, got_t, k, v, atol, rtol):
    """The (lo, hi) window of keys whose attention gives token t's output on every head,
    or None when no window of consecutive keys does (or the output is not finite)."""
    if not bool(torch.isfinite(got_t).all()):
        return None
    n = k.shape[0]
    for lo in range(n):
        for hi in range(lo, n):
            if bool(torch.isclose(got_t, _window(case, t, k, v, lo, hi), atol=atol, rtol=rtol).all()):
                return lo, hi
    return None


def _cell(text, style):
    return Text(text, style=style)


def draw_case(saved, console):
    """A (case, output) pair: per sequence, the mask grid and each row's verdict."""
    case, got = saved
    got = got.cpu()
    want = case.reference()
    atol, rtol = TOLERANCE[case.query.dtype]
    right = torch.isclose(got.double(), want, atol=atol, rtol=rtol).all(dim=-1)  # [T, H_q]
    unwritten = never_written(got).all(dim=-1)
    num_heads, bs = case.query.shape[1], case.block_size
    owned = owned_columns(case.seq_lens, bs, case.block_table.shape[1])
    starts, lens = case.query_start_loc.long().cpu().tolist(), case.seq_lens.long().cpu().tolist()
    console.print(f"[dim]H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={case.query.shape[2]}, block_size={bs}, "
                  f"dtype={str(case.query.dtype).replace('torch.', '')}; query i of a chunk of q_len sits at position "
                  f"seq_len - q_len + i and sees keys 0..its position (content/l3.md §3)[/]")
    wrong_rows = 0
    for b, n in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        context = n - q_len
        blocks = case.block_table[b].cpu()[owned[b]].tolist()
        console.print(Text(f"\nsequence {b}: seq_len {n} = prefix {context} + chunk {q_len}; it owns blocks "
                           f"{blocks} (block_table[{b}, :{len(blocks)}])", style="bold"))
        label_width = 18
        head = Text(f"{'physical block':<{label_width}}")
        for j, block in enumerate(blocks):
            span = 2 * min(bs, n - j * bs)
            head.append(f"{'#' + str(block):<{span}}" + ("  " if j + 1 < len(blocks) else ""), style="cyan")
        console.print(head)
        keys = Text(f"{'key position':<{label_width}}")
        for pos in range(n):
            keys.append(f"{pos % 100:<2}", style="dim" if pos < context else "bold")
            if (pos + 1) % bs == 0 and pos + 1 < n:
                keys.append("│ ", style="cyan")
        keys.append("  " + "".join(f"{'h' + str(h):>3}" for h in range(num_heads)))
        console.print(keys)
        k, v = _keys(case, b)
        for i in range(q_len):
            t, pos = starts[b] + i, context + i
            bad = not bool(right[t].all())
            wrong_rows += bad
            fit = _fitted_window(case, t, got[t].double(), k, v, atol, rtol) if bad and not unwritten[t].any() \
                else None
            row = Text(f"{f'q{i} (pos {pos})':<{label_width}}", style="bold red" if bad else "")
            for key in range(n):
                must = key <= pos
                seen = must if not bad or fit is None else fit[0] <= key <= fit[1]
                if must and seen:
                    row.append("■ ", style="green" if not bad else "white")
                elif must:
                    row.append("□ ", style="bold red")  # should see it, did not
                elif seen:
                    row.append("■ ", style="bold red")  # should not see it, did
                else:
                    row.append("· ", style="dim")
                if (key + 1) % bs == 0 and key + 1 < n:
                    row.append("│ ", style="cyan")
            row.append("  ")
            for h in range(num_heads):
                if unwritten[t, h]:
                    row.append(" · ", style="bold white on red")
                elif not torch.isfinite(got[t, h]).all():
                    row.append("NaN", style="bold red")
                else:
                    row.append(" ✓ " if right[t, h] else " ✗ ", style="green" if right[t, h] else "bold red")
            if bad and fit is not None:
                row.append(f"  fits keys {fit[0]}..{fit[1]}, not 0..{pos}", style="yellow")
            elif bad and not unwritten[t].any():
                row.append("  fits no window of consecutive keys", style="yellow")
            console.print(row)
    console.print(f"\n[dim]■ a key the row sees (green: the row is right)   · masked   red □ a key the row should "
                  f"see but its output leaves out   red ■ one it should not see but its output uses   ✓ right  "
                  f"✗ wrong  NaN non-finite  · never written (still the NaN out= held)   prefix positions dim, "
                  f"chunk positions bold[/]")
    console.print(f"[bold]{wrong_rows} of {len(got)} query rows wrong[/]" if wrong_rows else
                  "[green]every query row right[/]")


def picture(module, console):
    """Your kernel on PICTURE_CASE: a chunk of 4 over a prefix of 5 (ending mid-block),
    a pure prefill of 3 and a decode row over 6; NaN past each end."""
    case = paged_prefill_case(**PICTURE_CASE, device=_env.DEVICE)
    try:
        module.paged_prefill_attention(*case.args(), **case.kwargs())
    except NotImplementedError as error:
        console.print(said("", said_error(error), "yellow"),
                      Text("the grid shows the mask it should apply, every output still unwritten", style="yellow"))
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said("paged_prefill_attention raised ", said_error(error)))
    draw_case((case, case.out.view), console)
