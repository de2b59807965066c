"""L7's picture: the latent row split into c | k_pe with the columns that feed the score
and the value, then the worked example through the learner's write (each slot's row,
expected beside yours) and decode (each head's scores, weights, out and lse). `picture`
runs the learner's code; `draw_case` draws a failing decode case the tests saved."""
import torch
from rich.table import Table
from rich.text import Text

import _env
from _diagnose import said_error
from _picture import said

from .cases import WORKED_EXAMPLE, worked_example_decode_case, worked_example_numbers
from .reference import LSE_TOLERANCE, TOLERANCE


def _cells(prefix, n):
    return " ".join(f"{prefix}{i}" for i in range(n)) if n <= 4 else f"{prefix}0 {prefix}1 … {prefix}{n - 1}"


def _row_layout(rank, rope):
    """The latent row as one line of columns, and which of them each product reads."""
    c, pe = _cells("c", rank), _cells("pe", rope)
    row = Text.assemble("| ", (c, "bold cyan"), " | ", (pe, "bold magenta"), " |")
    under = Text.assemble("    ", ("└" + "─" * max(0, len(c) - 2) + "┘", "cyan"), "   ",
                          ("└" + "─" * max(0, len(pe) - 2) + "┘", "magenta"))
    score = Text.assemble("  score: ", ("q_nope · c", "cyan"), " + ", ("q_pe · k_pe", "magenta"),
                          f"   (all R + P = {rank + rope} columns, times scale)")
    value = Text.assemble("  value: ", ("c", "cyan"), " " * 22,
                          f"(the first R = {rank} columns: the key's own bytes, loaded once)")
    return Text.assemble(f"one latent row per token, R = {rank} then P = {rope} values:\n  ", row, "\n", under, "\n",
                         score, "\n", value)


def _fmt(values):
    return " ".join(f"{v:g}" for v in values)


def _draw_write(module, console):
    """The worked example's three tokens written by the learner's concat_and_cache_mla."""
    ex = WORKED_EXAMPLE
    kv_c, k_pe = torch.tensor(ex["kv_c"]), torch.tensor(ex["k_pe"])
    width = kv_c.shape[1] + k_pe.shape[1]
    cache = torch.full((ex["num_blocks"], ex["block_size"], width), float("nan"))
    yours = cache.to(_env.DEVICE)
    try:
        module.concat_and_cache_mla(kv_c.to(_env.DEVICE), k_pe.to(_env.DEVICE), yours,
                                    torch.tensor(ex["slots"], device=_env.DEVICE))
        yours = yours.cpu()
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said("concat_and_cache_mla: ", said_error(error), "yellow"))
        yours = cache
    table = Table(title="concat_and_cache_mla: each slot's row (c | k_pe)", header_style="bold", box=None,
                  padding=(0, 1))
    for column in ("slot", "block, offset", "token", "expected", "yours"):
        table.add_column(column)
    owner = {s: t for t, s in enumerate(ex["slots"])}
    flat = yours.view(-1, width)
    for slot in range(flat.shape[0]):
        t = owner.get(slot)
        want = f"{_fmt(kv_c[t].tolist())} | {_fmt(k_pe[t].tolist())}" if t is not None else "(untouched)"
        row = flat[slot]
        got = "(untouched)" if bool(torch.isnan(row).all()) else \
            f"{_fmt(row[:kv_c.shape[1]].tolist())} | {_fmt(row[kv_c.shape[1]:].tolist())}"
        ok = got == want
        table.add_row(str(slot), f"{slot // ex['block_size']}, {slot % ex['block_size']}",
                      f"t{t}" if t is not None else "", want, Text(got, style="green" if ok else "bold red"))
    console.print(table)


def _draw_decode(module, console):
    """The worked example's decode by the learner's mla_decode_attention (the expected cache,
    one split), head by head."""
    ex = WORKED_EXAMPLE
    case = worked_example_decode_case(_env.DEVICE)
    n = worked_example_numbers()
    try:
        out, lse = module.mla_decode_attention(*case.args(), num_splits=1)
        out, lse = out.cpu().double(), lse.cpu().double()
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(said("mla_decode_attention: ", said_error(error), "yellow"))
        out = lse = None
    table = Table(title=f"mla_decode_attention: scale = {ex['scale']}, one sequence of 3 tokens", header_style="bold",
                  box=None, padding=(0, 1))
    for column in ("head", "q_nope | q_pe", "scores t0 t1 t2", "weights", "expected out, lse", "yours"):
        table.add_column(column)
    atol, rtol = TOLERANCE[torch.float32]
    for h in range(len(ex["q_nope"])):
        want = f"{_fmt(round(v, 4) for v in n['out'][h].tolist())}, {n['lse'][h]:.4f}"
        if out is None:
            got = Text("—", style="dim")
        else:
            ok = bool(torch.allclose(out[0, h], n["out"][h], atol=atol, rtol=rtol)) and \
                abs(float(lse[0, h]) - float(n["lse"][h])) <= LSE_TOLERANCE[0]
            got = Text(f"{_fmt(round(v, 4) for v in out[0, h].tolist())}, {float(lse[0, h]):.4f}",
                       style="green" if ok else "bold red")
        table.add_row(f"h{h}", f"{_fmt(ex['q_nope'][h])} | {_fmt(ex['q_pe'][h])}",
                      _fmt(n["scores"][h].tolist()), _fmt(round(v, 4) for v in n["weights"][h].tolist()), want, got)
    console.print(table)
    wrong_scale = worked_example_numbers(scale=(len(ex["kv_c"][0]) + len(ex["k_pe"][0])) ** -0.5)
    no_rope = worked_example_numbers(rope=False)
    h0 = lambda numbers: _fmt(round(v, 4) for v in numbers["out"][0].tolist())  # noqa: E731
    console.print(f"[dim]the pitfalls on this example: with 1/sqrt(R + P) instead of the scale, h0 out "
                  f"{h0(wrong_scale)}; without q_pe · k_pe, h0 out {h0(no_rope)}[/]")


def picture(module, console):
    """The worked example: the row layout, your write, your decode."""
    ex = WORKED_EXAMPLE
    console.print(_row_layout(len(ex["kv_c"][0]), len(ex["k_pe"][0])))
    _draw_write(module, console)
    _draw_decode(module, console)


def _status(got_o, got_s, want_o, want_s, atol, rtol):
    if not bool(torch.isfinite(got_o).all()) or bool(torch.isnan(got_s)):
        return Text("NaN", style="bold red")
    ok = bool(torch.isclose(got_o, want_o, atol=atol, rtol=rtol).all()) and bool(
        torch.isclose(got_s, want_s, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1]))
    return Text("✓", style="green") if ok else Text("✗", style="bold red")


def draw_case(saved, console):
    """(case, out, lse) that failed: per sequence its length and per head right or wrong."""
    case, out, lse = saved
    want_o, want_s = case.reference()
    atol, rtol = TOLERANCE[case.q_nope.dtype]
    num_seqs, num_heads, rank = case.q_nope.shape
    console.print(_row_layout(rank, case.q_pe.shape[2]))
    console.print(f"[dim]B={num_seqs}, H={num_heads}, R={rank}, P={case.q_pe.shape[2]}, block_size={case.block_size}, "
                  f"num_splits={case.num_splits}, scale={case.scale:g}[/]")
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column in ("seq", "seq_len", *(f"h{h}" for h in range(num_heads))):
        table.add_column(column)
    o, s = out.double(), lse.double()
    for b in range(num_seqs):
        table.add_row(str(b), str(int(case.seq_lens[b])),
                      *(_status(o[b, h], s[b, h], want_o[b, h], want_s[b, h], atol, rtol) for h in range(num_heads)))
    console.print(table)
    console.print("[dim]✓ right (out and lse)   ✗ wrong   NaN non-finite (or never written)[/]")
