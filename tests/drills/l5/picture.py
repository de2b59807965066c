"""L5's picture: the learner's reshape_and_cache_fp8 on a few tokens (the page's worked
example among them: 0.3, 31.5 and 500 at scale 1), each slot's fp8 values expected and
written, a saturated value marked; then paged_decode_attention_fp8 on a small batch, each
(sequence, query head) output right or wrong. `picture` runs the learner's code and draws
what it did (L5's tests save no case to draw)."""
import torch
from rich.table import Table
from rich.text import Text

import _env
from _diagnose import said_error
from _paged import never_written, poisoned_out
from _picture import said

from .cases import WORKED_EXAMPLE, decode_case, write_case
from .checks import _close
from .reference import FP8_MAX, dequantised_attention, fp8_bytes, TOLERANCE

# Four tokens, one of them padding, H=2 heads of D=3 values, per-head scales: token 0's
# head 0 holds §3's worked example at scale 1, so 500 saturates to 448.
WRITE_CASE = dict(num_tokens=4, num_heads=2, head_size=3, block_size=4, dtype=torch.float32, k_scale=[1.0, 0.5],
                  v_scale=[2.0, 1.0], padding=(2,), spare_blocks=1, seed=1)
DECODE_CASE = dict(seq_lens=[3, 9], num_heads=2, num_kv_heads=1, head_size=8, block_size=4, dtype=torch.float32,
                   seed=2)


def write_example(device):
    case = write_case(**WRITE_CASE, device=device)
    case.key[0, 0] = torch.tensor(WORKED_EXAMPLE["values"])
    return case


def _values(row):
    return " ".join(f"{v:.4g}" for v in row.float().tolist())


def draw_write(case, console):
    """A write that ran: per real token and head, x / scale, the fp8 values expected and those
    in its slot, ✓ or ✗; a padding token's slot is -1 and nothing of it is written."""
    want_k, want_v = case.expected()
    console.print(f"[dim]{case.key.shape[0]} tokens, H={case.key.shape[1]}, D={case.key.shape[2]}, cache "
                  f"{str(case.k_cache.view.dtype).removeprefix('torch.')} (largest {FP8_MAX[case.k_cache.view.dtype]:g}),"
                  f" k_scale={case.k_scale.tolist()}, v_scale={case.v_scale.tolist()}: the cache holds "
                  f"fp8(saturate(x / scale)) (content/l5.md §3)[/]")
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("token", "slot", "", "head", "x / scale", "expected fp8", "your cache", ""):
        table.add_column(column)
    wrong = wrong_bytes = 0
    for name, rows, guarded, want, scale in (("K", case.key, case.k_cache, want_k, case.k_scale),
                                             ("V", case.value, case.v_cache, want_v, case.v_scale)):
        hd = rows.shape[1] * rows.shape[2]
        got_rows = guarded.storage.cpu()[guarded.margin:guarded.margin + guarded.view.numel()].view(-1, hd)
        want_rows, before = (t.cpu()[guarded.margin:guarded.margin + guarded.view.numel()].view(-1, hd)
                             for t in (want, guarded.initial))
        for t, slot in enumerate(case.slot_mapping.cpu().tolist()):
            if slot < 0:
                table.add_row(str(t), "-1", name, "", "padding: nothing written", "", "", "")
                continue
            for h in range(rows.shape[1]):
                cut = slice(h * rows.shape[2], (h + 1) * rows.shape[2])
                w, g = want_rows[slot, cut], got_rows[slot, cut]
                bad = int((fp8_bytes(w) != fp8_bytes(g)).sum())
                ok, wrong, wrong_bytes = not bad, wrong + bool(bad), wrong_bytes + bad
                untouched = bad and bool((fp8_bytes(g) == fp8_bytes(before[slot, cut])).all())
                quotient = rows[t, h].float().cpu() / scale.cpu().expand(rows.shape[1])[h]
                saturated = " (saturated)" if bool((quotient.abs() > FP8_MAX[w.dtype]).any()) else ""
                mark = Text("✓", style="green") if ok else Text("·", style="bold white on red") if untouched else \
                    Text("✗", style="bold red")
                table.add_row(str(t), str(slot), name, f"h{h}", _values(quotient), _values(w) + saturated,
                              "(never written)" if untouched else _values(g), mark)
    console.print(table)
    # Bytes changed where nothing is written: other slots, the padding token's, past the cache.
    elsewhere = sum(int((fp8_bytes(g.storage.cpu()) != fp8_bytes(w.cpu())).sum())
                    for g, w in ((case.k_cache, want_k), (case.v_cache, want_v))) - wrong_bytes
    console.print("[dim]✓ right   ✗ wrong   · never written (the pool's bytes before the call)[/]")
    console.print("[green]every slot right, and nothing else written[/]" if not wrong and not elsewhere else
                  f"[bold red]{wrong} (token, head) rows wrong; {elsewhere} bytes changed where nothing is written "
                  f"(other slots, before or past the cache)[/]")


def draw_decode(case, out, console):
    """paged_decode_attention_fp8's output per (sequence, query head) against the float64
    attention over the dequantised cache."""
    want = dequantised_attention(case)
    atol, rtol = TOLERANCE[case.query.dtype]
    right = _close(out.cpu().double(), want, atol, rtol)
    unwritten = never_written(out.cpu()).all(dim=-1)
    console.print(f"\n[bold]your paged_decode_attention_fp8[/] on seq_lens {case.seq_lens.tolist()}, block_size "
                  f"{case.block_size}, k_scale={_values(case.k_scale)}, v_scale={_values(case.v_scale)} (K and V "
                  f"read as fp8 · scale):")
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("seq", "seq_len", *(f"h{h}" for h in range(out.shape[1]))):
        table.add_column(column)
    for b in range(out.shape[0]):
        cells = [Text("·", style="bold white on red") if unwritten[b, h] else
                 Text("NaN", style="bold red") if not bool(torch.isfinite(out[b, h].cpu()).all()) else
                 Text("✓", style="green") if right[b, h] else Text("✗", style="bold red") for h in range(out.shape[1])]
        table.add_row(str(b), str(int(case.seq_lens[b])), *cells)
    console.print(table)
    console.print("[dim]✓ right   ✗ wrong   NaN non-finite   · never written[/]")


def picture(module, console):
    """Your write on WRITE_CASE, then your decode on DECODE_CASE."""
    case = write_example(_env.DEVICE)
    try:
        module.reshape_and_cache_fp8(*case.args())
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said("reshape_and_cache_fp8 raised ", said_error(error)))
    draw_write(case, console)
    decode = decode_case(**DECODE_CASE, device=_env.DEVICE)
    out = poisoned_out(decode.query.shape, decode.query.dtype, decode.query.device, torch.Generator().manual_seed(0))
    try:
        module.paged_decode_attention_fp8(*decode.args(), **decode.kwargs(), out=out.view)
    except Exception as error:
        console.print(said("paged_decode_attention_fp8 raised ", said_error(error)))
    draw_decode(decode, out.view, console)
