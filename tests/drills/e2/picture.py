"""E2's picture: the worked example (content/e2.md §4) replayed on the learner's block
manager, each sequence's blocks drawn in a row, shared blocks marked, and what each
allocate reused."""
from rich.table import Table
from rich.text import Text

from _picture import plain, said

from .cases import WORKED_EXAMPLE


def picture(module, console):
    ex = WORKED_EXAMPLE
    ops = list(ex["ops"])
    probe = ops[:2] + [("block_table", ["A", "B"])] + ops[2:] + [("block_table", ["B", "C"])]
    try:
        got = module.replay_prefix_cache(ex["num_blocks"], ex["block_size"], probe)
    except Exception as error:  # noqa: BLE001 -- the learner's error is what the picture shows
        console.print(said("replay_prefix_cache raised: ", f"{type(error).__name__}: {error}"))
        return
    table = Table(title=f"the worked example (content/e2.md §4): blocks of {ex['block_size']}, "
                        f"{ex['num_blocks']} in the cache", box=None, header_style="bold")
    table.add_column("op")
    table.add_column("result")
    for op, result in zip(probe, got):
        shown = str(op if len(str(op)) < 60 else (*op[:2], "..."))
        if op[0] == "block_table" and hasattr(result, "tolist"):
            rows = result.tolist()
            counts = {}
            for row in rows:
                for b in row:
                    counts[b] = counts.get(b, 0) + (b >= 0)
            cells = Text()
            for seq, row in zip(op[1], rows):
                cells.append(f"{seq}: ")
                for b in row:
                    style = "bold green" if counts.get(b, 0) > 1 else ("dim" if b < 0 else "")
                    cells.append(f"{b:>3}", style=style)
                cells.append("   ")
            table.add_row(shown, cells)
        else:
            table.add_row(shown, plain(result))
    console.print(table)
    console.print(Text("green: a block two sequences share (reference count 2)", style="green"))
