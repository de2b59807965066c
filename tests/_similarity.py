"""Copy detection for a class: which learners' files for one drill are near-identical
once names, literals, comments and whitespace are set aside. Names no drill; the
class grade (tests/_class.py) hands it the files. It flags, it never fails anyone.

How, as MOSS does it (Schleimer, Wilkerson and Aiken, "Winnowing", SIGMOD 2003):
- Python's own tokenizer reads the file; comments and blank lines go, every string
  becomes S and every number 0, and every name the file could have chosen (its
  variables, functions, parameters, import aliases) becomes V. What a copier does not
  rename stays: keywords, builtins, attributes (`.load`, `.program_id`) and keyword
  arguments (`mask=`). Renaming, re-commenting and re-spacing a file leaves its tokens
  as they were.
- Every run of K tokens is hashed; winnowing keeps the smallest hash of each window of
  W consecutive runs, so any match of K + W - 1 tokens or more is certainly seen.
- What the stub already holds (signatures, docstrings, given helpers) is the base
  every learner starts from: its fingerprints are dropped, as MOSS's -b does.
- Two files' score is the share of the smaller one's fingerprints found in the other:
  a copy scores near 1 however it was renamed; honest answers to one short drill share
  idioms (a program id, an arange, a masked load) but not their order. A pair is flagged
  at `THRESHOLD` and up, with at least `MIN_SHARED` fingerprints in common.
"""
import builtins
import hashlib
import io
import keyword
import tokenize

K, W = 12, 6
THRESHOLD, MIN_SHARED = 0.6, 8
_BUILTINS = frozenset(dir(builtins))
_DROPPED = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
_STRINGS = {tokenize.STRING} | {getattr(tokenize, name) for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END",
                                                                    "TSTRING_START", "TSTRING_MIDDLE", "TSTRING_END")
                                  if hasattr(tokenize, name)}


def tokens(source):
    """The normalised tokens of `source`: [(text, line)]. A file that does not tokenize
    to its end (a syntax error) gives the tokens before the error."""
    out, depth, raw = [], 0, []
    try:
        raw = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        # generate_tokens is lazy: read again up to the error, keeping what it gave.
        reader = tokenize.generate_tokens(io.StringIO(source).readline)
        try:
            for tok in reader:
                raw.append(tok)
        except (tokenize.TokenError, SyntaxError):
            pass
    for i, tok in enumerate(raw):
        kind, text, line = tok.type, tok.string, tok.start[0]
        if kind in _DROPPED:
            continue
        if kind == tokenize.OP:
            depth += text in "([{"
            depth -= text in ")]}"
        if kind in _STRINGS:
            if out and out[-1][0] == "S":  # an implicit concatenation or an f-string's parts: one S
                continue
            text = "S"
        elif kind == tokenize.NUMBER:
            text = "0"
        elif kind == tokenize.NAME and not keyword.iskeyword(text) and text not in _BUILTINS:
            after_dot = i > 0 and raw[i - 1].string == "."
            keyword_argument = depth > 0 and i + 1 < len(raw) and raw[i + 1].string == "="
            if not (after_dot or keyword_argument):
                text = "V"
        elif kind == tokenize.NEWLINE:
            text = ";"
        elif kind == tokenize.INDENT:
            text = "{"
        elif kind == tokenize.DEDENT:
            text = "}"
        out.append((text, line))
    return out


def _hash(texts):
    return int.from_bytes(hashlib.blake2b("\x1f".join(texts).encode(), digest_size=8).digest(), "big")


def fingerprints(source, base=frozenset()):
    """{hash: [(first line, last line), ...]} of the K-token runs winnowing keeps,
    those of `base` (a set of hashes: the stub's) left out."""
    toks = tokens(source)
    grams = [(_hash([t for t, _ in toks[i:i + K]]), toks[i][1], toks[i + K - 1][1]) for i in range(len(toks) - K + 1)]
    kept = {}
    last = None
    for start in range(max(1, len(grams) - W + 1)):
        window = grams[start:start + W]
        if not window:
            break
        # The rightmost smallest hash of the window, kept once however many windows pick it.
        pick = min(range(len(window)), key=lambda j: (window[j][0], -j)) + start
        if pick != last:
            h, first, end = grams[pick]
            if h not in base:
                kept.setdefault(h, []).append((first, end))
            last = pick
    return kept


def base_hashes(source):
    """Every K-token hash of a base file (the stub): not only those winnowing keeps, so
    that no run of it counts wherever a window picks it in a learner's file."""
    toks = [t for t, _ in tokens(source)]
    return frozenset(_hash(toks[i:i + K]) for i in range(len(toks) - K + 1))


def compare(a, b):
    """(score, shared, regions) of two files' fingerprints: the share of the smaller's
    fingerprints found in the other, how many, and the matching regions as
    [((a first, a last), (b first, b last))], line ranges merged where they touch."""
    shared = set(a) & set(b)
    smaller = min(len(a), len(b))
    score = len(shared) / smaller if smaller else 0.0
    spans = sorted((min(a[h])[0], max(e for _, e in a[h]), min(b[h])[0], max(e for _, e in b[h])) for h in shared)
    regions = []
    for a0, a1, b0, b1 in spans:
        if regions and a0 <= regions[-1][1] + 1 and b0 <= regions[-1][3] + 1 and b1 >= regions[-1][2] - 1:
            r = regions[-1]
            regions[-1] = (r[0], max(r[1], a1), min(r[2], b0), max(r[3], b1))
        else:
            regions.append((a0, a1, b0, b1))
    return score, len(shared), [((a0, a1), (b0, b1)) for a0, a1, b0, b1 in regions]


def flagged(score, shared):
    return score >= THRESHOLD and shared >= MIN_SHARED


def pairs(files, base="", reference=None, common=0.5):
    """The flagged pairs of one drill's files ({learner: source}): [(score, shared, a, b,
    regions)], highest score first, where b may be "solutions/" (the reference's source).
    A fingerprint found in more than `common` of the learners' files (and in five at
    least) is an idiom of the drill, as MOSS's -m drops it: not counted between learners."""
    drop = base_hashes(base) if base else frozenset()
    prints = {name: fingerprints(source, drop) for name, source in sorted(files.items())}
    seen = {}
    for found in prints.values():
        for h in found:
            seen[h] = seen.get(h, 0) + 1
    idioms = {h for h, n in seen.items() if n > max(5, common * len(prints))}
    names, out = sorted(prints), []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa = {h: v for h, v in prints[a].items() if h not in idioms}
            pb = {h: v for h, v in prints[b].items() if h not in idioms}
            score, shared, regions = compare(pa, pb)
            if flagged(score, shared):
                out.append((score, shared, a, b, regions))
    if reference is not None:
        theirs = fingerprints(reference, drop)
        for a in names:
            score, shared, regions = compare(prints[a], theirs)
            if flagged(score, shared):
                out.append((score, shared, a, "solutions/", regions))
    return sorted(out, key=lambda p: (-p[0], p[2], p[3]))


# --- the class's report ------------------------------------------------------------------

def class_report(learners, drills, stubs, roster):
    """similarity.md for a class: per drill, the flagged pairs of learners' graded files
    (untouched stubs and missing files aside) and the files near-identical to the
    reference, each with its score, the fingerprints shared, the matching line ranges and
    the command that puts the two side by side. `learners`: dicts with slug, tree, files
    ({stem: bytes}); `stubs`: {stem: bytes}."""
    from _tree import ROOT
    lines = [f"# Similarity: {roster}", "",
             "Flags, never fails: a pair here is a reason to look, not a verdict. Each file is read as Python tokens "
             "with names, strings, numbers, comments and whitespace set aside; runs of "
             f"{K} tokens are fingerprinted and winnowed (window {W}), as MOSS does; what the stub already holds "
             "does not count. The score is the share of the smaller file's fingerprints found in the other; a pair is "
             f"flagged from {THRESHOLD:.0%} with at least {MIN_SHARED} fingerprints in common. `solutions/` is the "
             "reference. Regions are line ranges (first file ~ second file).", ""]
    trees = {one["slug"]: one["tree"] for one in learners}
    for drill in drills:
        stub = stubs[drill.stem]
        files = {one["slug"]: one["files"][drill.stem].decode(errors="replace") for one in learners
                 if one["files"].get(drill.stem, stub) != stub}
        reference = (ROOT / "solutions" / f"{drill.stem}.py").read_text()
        found = pairs(files, stub.decode(errors="replace"), reference)
        lines += [f"## {drill.id.upper()} ({drill.stem}.py)", "",
                  f"{len(files)} learner file(s) compared (untouched stubs and missing files aside); "
                  f"{len(found)} pair(s) flagged.", ""]
        if not found:
            continue
        lines += ["| score | first | second | shared | matching regions | side by side |", "|---|---|---|---|---|---|"]
        for score, shared, a, b, regions in found:
            where = "; ".join(f"{a0}-{a1} ~ {b0}-{b1}" for (a0, a1), (b0, b1) in regions[:6])
            where += f" (+{len(regions) - 6} more)" if len(regions) > 6 else ""
            other = "solutions" if b == "solutions/" else trees[b]
            command = f"make diff DRILL={drill.id} TREE={_quoted(trees[a])} OTHER={_quoted(other)}"
            lines.append(f"| {score:.0%} | {a} | {b} | {shared} | {where} | `{command}` |".replace("\n", " "))
        lines.append("")
    return "\n".join(lines) + "\n"


def _quoted(path):
    import shlex
    return shlex.quote(str(path)).replace("|", "\\|")
