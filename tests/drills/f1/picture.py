"""Drill F1's picture: the worked example run through the learner's code, and
draw_case, the K cache's pages as they should be and as the learner's code left them.
"""
import torch

from _paged import bits

from .cases import WORKED_EXAMPLE, worked_example_case
from .checks import _whose_page
from .reference import as_nhd

# ---------------------------------------------------------------------------
# The picture: the K cache's pages as they should be and as the learner's code left them

SEQ_STYLE = ("bold blue", "bold magenta", "bold cyan", "bold yellow")


def _page_labels(case, storages):
    """{(page, entry): Text} for the K cache in `storages`: whose values sit there."""
    from rich.text import Text

    now = as_nhd(case.caches(storages)[0], case.kv_layout).cpu()
    before = as_nhd(case.caches("initial")[0], case.kv_layout).cpu()
    rows = [bits(case.key[t].cpu()) for t in range(case.key.shape[0])]
    labels = {}
    for page in range(now.shape[0]):
        for entry in range(now.shape[1]):
            cell = bits(now[page, entry])
            if torch.equal(cell, bits(before[page, entry])):
                labels[page, entry] = Text("·", style="dim")
                continue
            t = next((t for t, row in enumerate(rows) if torch.equal(cell, row)), None)
            if t is None:
                labels[page, entry] = Text("?", style="bold white on red")
            elif int(case.batch_indices[t]) < 0:
                labels[page, entry] = Text(f"t{t}!", style="bold white on red")
            else:
                labels[page, entry] = Text(f"t{t}", style=SEQ_STYLE[int(case.batch_indices[t]) % len(SEQ_STYLE)])
    return labels


def _guards_hit(case, storages):
    return any(bool((bits(s.cpu())[:g.margin] != bits(g.initial.cpu())[:g.margin]).any()
                    | (bits(s.cpu())[g.margin + g.view.numel():]
                       != bits(g.initial.cpu())[g.margin + g.view.numel():]).any())
               for g, s in zip(case.storages, storages))


def _pages_table(title, case, labels, shown):
    from rich.table import Table

    table = Table(title=title, header_style="bold", box=None, padding=(0, 1))
    table.add_column("page", justify="right")
    table.add_column("owner")
    for entry in range(case.page_size):
        table.add_column(f"+{entry}", justify="center")
    for page in shown:
        owner = _whose_page(case, page).split(" (")[0].replace("sequence ", "seq ")
        owner = "spare" if owner.startswith("a page") else owner
        table.add_row(str(page), owner, *[labels[page, e] for e in range(case.page_size)])
    return table


def draw_case(case, console):
    """A case that already ran: the K cache's pages, expected next to yours."""
    from rich.columns import Columns

    want = _page_labels(case, case.expected())
    got = _page_labels(case, [g.storage for g in case.storages])
    touched = sorted({p for labels in (want, got) for (p, _), cell in labels.items() if cell.plain != "·"})
    num_pages = case.caches()[0].shape[0]
    shown = list(range(num_pages)) if num_pages <= 12 else touched
    console.print(f"[dim]kv_layout={case.kv_layout}, kv_indptr={case.kv_indptr.tolist()}, "
                  f"kv_indices={case.kv_indices.tolist()}, batch_indices={case.batch_indices.tolist()}, "
                  f"positions={case.positions.tolist()}[/]")
    console.print(Columns([_pages_table("k_cache, expected", case, want, shown),
                           _pages_table("k_cache, yours", case, got, shown)], padding=(0, 6)))
    if _guards_hit(case, [g.storage for g in case.storages]):
        console.print("[bold red]values were written outside the cache (its guard regions changed)[/]")
    console.print("[dim]tN: token N's key (colour = its sequence)   ·: untouched   tN!: a padding token's values   "
                  "?: changed to values of no token (wrong layout, or a partial write)[/]")


def picture(module, console):
    """§2 and §5's example with H=2, D=3 (H*D not a power of two), key/value read from a
    fused-QKV view and one padding token: the CSR arrays, each token's (b, position), and the pages."""
    from rich.table import Table
    from rich.text import Text

    import _env
    from _diagnose import error_name, said_error
    from _picture import plain, said

    ex = WORKED_EXAMPLE
    device = _env.DEVICE
    table = torch.tensor(ex["block_table"], dtype=torch.int32, device=device)
    lens = torch.tensor(ex["seq_lens"], dtype=torch.int32, device=device)
    rows = Table(title="block_table_to_csr and batch_indices_positions", header_style="bold", box=None,
                 padding=(0, 1))
    for column in ("array", "expected", "yours"):
        rows.add_column(column)

    def show(names, want, call):
        try:
            got = [t.tolist() for t in call()]
        except Exception as error:  # the picture draws whatever the learner's code does
            got = [plain(error_name(error))] * len(names)  # their error's name: their text, plain
        for name, w, g in zip(names, want, got):
            rows.add_row(name, str(w), g if isinstance(g, Text) else Text(str(g), style="green" if g == w else
                                                                          "bold red"))

    show(("kv_indptr", "kv_indices", "kv_last_page_len"),
         (ex["kv_indptr"], ex["kv_indices"], ex["kv_last_page_len"]),
         lambda: module.block_table_to_csr(table, lens, ex["page_size"]))
    indptr = torch.tensor(ex["append_indptr"], dtype=torch.int32, device=device)
    show(("batch_indices", "positions"), (ex["batch_indices"] + [-1], ex["positions"] + [0]),
         lambda: module.batch_indices_positions(indptr, lens, ex["append_indptr"][-1] + 1))
    console.print(rows)

    case = worked_example_case(device, num_heads=2, head_size=3, rows="fused_qkv", padding=1)
    try:
        module.append_paged_kv_cache(*case.args())
    except Exception as error:
        console.print(said("append_paged_kv_cache raised ", said_error(error)))
    draw_case(case, console)
