"""L1's picture: the cache as it should be and as the learner's code left it
(`draw_case` for a saved failing case, `picture` for the page's worked example)."""
import _env
from rich.columns import Columns
from rich.table import Table
from rich.text import Text

from _diagnose import error_name, said_error
from _paged import bits, same_bits
from _picture import plain, said

from .cases import WORKED_EXAMPLE, kv_write_case

SEQ_STYLE = ("bold blue", "bold magenta", "bold cyan", "bold yellow")


def _label_slots(case, cache, storage, rows):
    """One label per slot (and per guard) of a cache's storage: whose values are there."""
    num_tokens = rows.shape[0]
    hd = rows[0].numel() if num_tokens else 1
    margin, size = cache.margin, cache.view.numel()
    before = cache.initial
    token_rows = [bits(rows[t].reshape(-1)) for t in range(num_tokens)]

    def label(now, was):
        if bool((bits(now) == bits(was)).all()):
            return Text("·", style="dim")
        for t, row in enumerate(token_rows):
            if bool((bits(now) == row).all()):
                seq = int(case.seq_idx[t])
                if int(case.slot_mapping[t]) < 0:
                    return Text(f"t{t}!", style="bold white on red")  # a padding token's values
                return Text(f"t{t}", style=SEQ_STYLE[seq % len(SEQ_STYLE)])
        return Text("?", style="bold white on red")  # changed, but to no token's values

    slots = [label(storage[margin + s * hd:margin + (s + 1) * hd], before[margin + s * hd:margin + (s + 1) * hd])
             for s in range(size // hd)]
    front = label(storage[margin - hd:margin], before[margin - hd:margin])
    back = label(storage[margin + size:margin + size + hd], before[margin + size:margin + size + hd])
    return slots, front, back


def _cache_table(title, case, labels, front, back, shown):
    block_size = case.block_size
    table = Table(title=title, show_header=True, header_style="bold", box=None, padding=(0, 1))
    table.add_column("block", justify="right")
    for i in range(block_size):
        table.add_column(f"+{i}", justify="center")
    table.add_row("slot -1", front, *[""] * (block_size - 1))
    for block in range(len(labels) // block_size):
        row = labels[block * block_size:(block + 1) * block_size]
        if block in shown:
            table.add_row(str(block), *row)
        elif block - 1 in shown or block == 0:
            table.add_row("⋮", *[""] * block_size)  # a run of untouched blocks
    table.add_row("past end", back, *[""] * (block_size - 1))
    return table


def draw_case(case, console):
    """A case that already ran (saved by the tests when it failed): draw the cache that
    is wrong (k_cache unless only v_cache is), expected beside yours."""
    want_k, want_v = case.expected()
    name, cache, expected, rows = "k_cache", case.k_cache, want_k, case.key
    if same_bits(case.k_cache.storage, want_k) and not same_bits(case.v_cache.storage, want_v):
        name, cache, expected, rows = "v_cache", case.v_cache, want_v, case.value
    want, got = _label_slots(case, cache, expected, rows), _label_slots(case, cache, cache.storage, rows)
    # Draw every block either side touched, and the page's small examples whole.
    num_blocks = len(want[0]) // case.block_size
    shown = {s // case.block_size for labels in (want[0], got[0]) for s, cell in enumerate(labels) if cell.plain != "·"}
    shown = set(range(num_blocks)) if num_blocks <= 12 else shown
    want = _cache_table(f"{name}, expected", case, *want, shown)
    got = _cache_table(f"{name}, yours", case, *got, shown)
    console.print(f"[dim]slot_mapping = {case.slot_mapping.tolist()}; tokens' sequences = {case.seq_idx.tolist()}, "
                  f"positions = {case.positions.tolist()}[/]")
    console.print(Columns([want, got], padding=(0, 6)))
    console.print("[dim]tN: token N's values (colour = its sequence)   ·: untouched   "
                  "tN!: a padding token's values   ?: overwritten with values of no token[/]")


def picture(module, console):
    """§4's worked example plus one padding token, with H=2, D=3 (H*D is not a
    power of two) read from a fused-QKV view: small enough to draw, rich enough
    that every pitfall on the page shows."""
    ex = WORKED_EXAMPLE
    case = kv_write_case(ex["block_table"], ex["num_blocks"], ex["seq_idx"], ex["positions"], ex["block_size"],
                         num_heads=2, head_size=3, padding=[3], layout="fused_qkv", device=_env.DEVICE, seed=7)
    real = case.slot_mapping >= 0
    try:
        slots = module.slot_mapping(case.block_table, case.seq_idx[real], case.positions[real], case.block_size)
        yours = [str(s) for s in slots.tolist()]
    except Exception as error:  # the picture must draw whatever the learner's code does
        yours = [plain(error_name(error))] * int(real.sum())  # their error's name: their text, plain
    slot_table = Table(title="slot_mapping", header_style="bold", box=None, padding=(0, 1))
    for column in ("token", "seq", "position", "expected slot", "yours"):
        slot_table.add_column(column, justify="right")
    mine = iter(yours)
    for t in range(len(case.slot_mapping)):
        if not real[t]:
            slot_table.add_row(f"t{t}", "pad", "-", "-1", Text("(padding)", style="dim"))
            continue
        want, got = str(int(case.slot_mapping[t])), next(mine)
        cell = got if isinstance(got, Text) else Text(got, style="green" if got == want else "bold red")
        slot_table.add_row(Text(f"t{t}", style=SEQ_STYLE[int(case.seq_idx[t])]), str(int(case.seq_idx[t])),
                           str(int(case.positions[t])), want, cell)
    console.print(slot_table)

    try:
        module.reshape_and_cache(*case.args())
    except Exception as error:
        console.print(said("reshape_and_cache raised ", said_error(error)))
    draw_case(case, console)
