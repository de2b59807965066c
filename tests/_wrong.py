"""Known-wrong solutions: the reference with exactly one pitfall planted.

tests/wrong/<stem>.py maps each pitfall named on the drill's page to edits of
solutions/<stem>.py. Keeping edits instead of whole copies means a change to
the reference carries over to every variant, and an edit that no longer
applies fails loudly instead of silently testing nothing.
"""
import importlib.util

from _tree import ROOT


def pitfalls(stem):
    """{pitfall name: [(old, new), ...]} for a drill, or {} if it has none yet."""
    path = ROOT / "tests" / "wrong" / f"{stem}.py"
    if not path.exists():
        return {}
    spec = importlib.util.spec_from_file_location(f"wrong_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PITFALLS


def plant(stem, pitfall, folder):
    """Write the reference with `pitfall` planted to folder/<stem>.py; return folder."""
    source = (ROOT / "solutions" / f"{stem}.py").read_text()
    for old, new in pitfalls(stem)[pitfall]:
        if source.count(old) != 1:
            raise ValueError(f"{stem}/{pitfall}: {old!r} appears {source.count(old)} times in the reference, not once")
        source = source.replace(old, new)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.py").write_text(source)
    return folder
