"""L2's picture: which (sequence, query head) outputs are right, and the blocks each
sequence owns, for the learner's kernel (`picture`) or a failing case the tests saved
(`draw_case`)."""
import torch
from rich.table import Table
from rich.text import Text

import _env
from _diagnose import said_error
from _paged import never_written, owned_columns, poisoned_out
from _picture import said

from .cases import small_case
from .checks import _close
from .reference import DECODE_TOLERANCE


def draw_case(saved, console):
    """A case that already ran: one row per sequence, one cell per query head."""
    case, got = saved
    want = case.reference()
    atol, rtol = DECODE_TOLERANCE[case.query.dtype]
    right = _close(got.float().cpu(), want, atol, rtol)
    unwritten = never_written(got.cpu()).all(dim=-1) if got.is_floating_point() else torch.zeros_like(right)
    num_heads, group = case.query.shape[1], case.query.shape[1] // case.k_cache.shape[2]
    table = Table(header_style="bold", box=None, padding=(0, 1))
    table.add_column("seq")
    table.add_column("seq_len")
    table.add_column("blocks it reads (block_table row, owned columns)")
    for h in range(num_heads):
        table.add_column(f"h{h}" + ("|" if (h + 1) % group == 0 and h + 1 < num_heads else ""), justify="center")
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    for b in range(case.query.shape[0]):
        cells = []
        for h in range(num_heads):
            if unwritten[b, h]:
                cells.append(Text("·", style="bold white on red"))
            elif not torch.isfinite(got[b, h].float()).all():
                cells.append(Text("NaN", style="bold red"))
            else:
                cells.append(Text("✓", style="green") if right[b, h] else Text("✗", style="bold red"))
        blocks = case.block_table[b].cpu()[owned[b]].tolist()
        table.add_row(str(b), str(int(case.seq_lens[b])), str(blocks), *cells)
    console.print(f"[dim]H_q={num_heads}, H_kv={case.k_cache.shape[2]} (| separates the query heads of one KV "
                  f"head), D={case.query.shape[2]}, block_size={case.block_size}[/]")
    console.print(table)
    console.print("[dim]✓ right   ✗ wrong   NaN non-finite   ·: never written (still the NaN out= held)[/]")


def picture(module, console):
    """Your kernel on a small GQA batch: sequences of 5, 17 and 33 tokens (a partial
    last block, one token into a new block, several blocks), NaN past each end."""
    case = small_case(_env.DEVICE, [5, 17, 33], tail="nan", seed=3)
    out = poisoned_out(case.query.shape, case.query.dtype, case.query.device, torch.Generator().manual_seed(0))
    try:
        module.paged_decode_attention(*case.args(), **case.kwargs(), out=out.view)
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said("paged_decode_attention raised ", said_error(error)))
    draw_case((case, out.view), console)
