"""L8's picture: for each sequence of a small batch, the window over its keys (one row per
query token, one column per key, grouped by block; dead blocks before the window marked),
the sink as one more column, and each row's outputs marked right or wrong. `picture` runs
the learner's code on that batch; `draw_case` draws a (case, output) pair that already ran."""
import torch
from rich.text import Text

import _env
from _diagnose import said_error
from _paged import never_written
from _picture import said

from .cases import window_case
from .reference import TOLERANCE

# A chunk of 4 over a prefix of 9 and a decode row at position 12; blocks of 4, window_left 5:
# block 0 is dead in both (its entry is -1).
PICTURE_CASE = dict(q_lens=[4, 1], context_lens=[9, 12], window_left=5, num_heads=2, num_kv_heads=1, head_size=8,
                    block_size=4, dtype=torch.float32, dead="-1", sinks="random", seed=3)


def draw_case(saved, console):
    """A (case, output) pair: per sequence, the window grid and each row's verdict."""
    case, got = saved
    got = got.cpu()
    want = case.reference()
    atol, rtol = TOLERANCE[case.query.dtype]
    right = torch.isclose(got.double(), want, atol=atol, rtol=rtol).all(dim=-1)
    unwritten = never_written(got).all(dim=-1)
    num_heads, bs, w = case.query.shape[1], case.block_size, case.window_left
    sinks = "none" if case.sinks is None else ", ".join(f"{float(s):.2f}" for s in case.sinks.cpu())
    console.print(f"[dim]{case.function}: window_left={w} (a query at p sees keys p - {w} .. p), sinks [{sinks}], "
                  f"H_q={num_heads}, block_size={bs} (content/l8.md §4)[/]")
    starts, lens = case.query_start_loc.long().cpu().tolist(), case.seq_lens.long().cpu().tolist()
    wrong_rows = 0
    for b, n in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        context = n - q_len
        table = case.block_table[b].cpu().tolist()
        console.print(Text(f"\nsequence {b}: seq_len {n} = prefix {context} + {q_len} new", style="bold"))
        head = Text(f"{'block-table entry':<18}")
        for j in range(-(-n // bs)):
            dead = (j + 1) * bs <= context - w and w >= 0
            label = "dead" if dead else f"#{table[j]}"
            head.append(f"{label:<{2 * min(bs, n - j * bs)}}" + "  ", style="red dim" if dead else "cyan")
        console.print(head)
        keys = Text(f"{'key position':<18}")
        for pos in range(n):
            keys.append(f"{pos % 100:<2}", style="dim" if pos < context else "bold")
            if (pos + 1) % bs == 0 and pos + 1 < n:
                keys.append("│ ", style="cyan")
        keys.append("  sink " + "".join(f"{'h' + str(h):>3}" for h in range(num_heads)))
        console.print(keys)
        for i in range(q_len):
            t, pos = starts[b] + i, context + i
            bad = not bool(right[t].all())
            wrong_rows += bad
            row = Text(f"{f'q{i} (pos {pos})':<18}", style="bold red" if bad else "")
            for key in range(n):
                seen = key <= pos and (w < 0 or key >= pos - w)
                row.append("■ " if seen else "· ", style="green" if seen else "dim")
                if (key + 1) % bs == 0 and key + 1 < n:
                    row.append("│ ", style="cyan")
            row.append("  " + (" ◆   " if case.sinks is not None else " -   "), style="magenta")
            for h in range(num_heads):
                if unwritten[t, h]:
                    row.append(" · ", style="bold white on red")
                elif not torch.isfinite(got[t, h]).all():
                    row.append("NaN", style="bold red")
                else:
                    row.append(" ✓ " if right[t, h] else " ✗ ", style="green" if right[t, h] else "bold red")
            console.print(row)
    console.print("\n[dim]■ a key in the row's window   · outside it (never loaded, if its whole tile is)   ◆ the "
                  "sink: one more logit in the softmax, no value   dead: a block wholly before every window, whose "
                  "entry may be garbage   ✓ right  ✗ wrong  NaN non-finite  · never written[/]")
    console.print(f"[bold]{wrong_rows} of {len(got)} query rows wrong[/]" if wrong_rows else
                  "[green]every query row right[/]")


def picture(module, console):
    """Your prefill on PICTURE_CASE: a chunk of 4 over a prefix of 9 and a decode row at 12."""
    case = window_case(**PICTURE_CASE, device=_env.DEVICE)
    try:
        case.call(module)
    except NotImplementedError as error:
        console.print(said("", said_error(error), "yellow"),
                      Text("the grid shows the window it should apply, every output still unwritten", style="yellow"))
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said(f"{case.function} raised ", said_error(error)))
    draw_case((case, case.out.view), console)
