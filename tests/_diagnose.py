"""The diagnosis engine: turns a wrong answer into sentences a learner can act on.
Names no drill; each drill's module holds its own checks and sentences and calls
these pieces.

The rules every check follows, so that the grade never lies:
1. An output that is non-finite, or still holds the poison it started with, is
   reported as exactly that, before any matching.
2. A pitfall is named only on evidence no simpler story fits: the learner's output
   is what the planted mistake produces (bit for bit for copies; for attention within
   tolerance AND, on the same elements, far from the right answer), on a case where
   the mistake changes the answer.
3. When unsure, say what is wrong (which token, slot, sequence, head, block) and
   name nothing.
"""
import re
from contextlib import contextmanager

import pytest
import torch

import _env
import _wrong
from _paged import Guarded, bits, never_written, same_bits
from _worker import LearnerCrash, LearnerError, LearnerTimeout


class Mismatch(AssertionError):
    """A wrong answer, explained. First line: the finding; then the evidence.
    `pitfalls` lists the page's pitfalls the evidence singles out (often none);
    `undecided` those it can neither confirm nor rule out (the planted mistake races
    on this input, so its output is not one answer)."""

    def __init__(self, message, pitfalls=(), undecided=()):
        super().__init__(message)
        self.pitfalls = list(pitfalls)
        self.undecided = list(undecided)


# The inputs refused as they should be during the current test (reset per test by
# tests/_plugin.py): a test that passes on refusals alone is marked `rejects`, and the grade
# counts such passes only once the drill's worked example passes (tests/_grading.py).
REFUSED = []


class DoesNotImport(pytest.fail.Exception):
    """The learner's file does not import (tests/_plugin.py asks before any test of its drill
    runs): one line saying so, then the line and a caret under where it stopped. A pytest
    failure without a traceback: a learner running pytest reads the message alone."""

    def __init__(self, message):
        super().__init__(message, pytrace=False)


def does_not_import(path, error):
    """The DoesNotImport for `error`, raised by the worker's import of `path` (as a line shows
    it): the learner's error (said_error) and, from where it was raised (`error.where`:
    "file:line: code", a SyntaxError's with a caret line under it), the line and a caret."""
    where = getattr(error, "where", None) or ""
    head, _, caret = where.partition("\n")
    match = re.match(r"(?s).*?:(\d+): (.*)", head)
    said = re.sub(r" \([^()\n]*, line \d+\)$", "", said_error(error))  # a SyntaxError's "(file, line N)": said below
    if not match:
        return DoesNotImport(f"{path} does not import: {said}")
    code = match.group(2)
    caret = caret or "^" * len(code)  # an error raised by a line: the whole line
    return DoesNotImport(f"{path} does not import, line {match.group(1)}: {said}\n    {code}\n    {caret}")


@contextmanager
def expect_value_error(what, section, pitfall=None):
    """The block must raise ValueError; anything else is explained. `pitfall` names
    the page's pitfall that accepting this input is (the evidence is the acceptance)."""
    try:
        yield
    except ValueError:
        REFUSED.append(what)
        return
    except NotImplementedError:
        raise
    except Exception as error:  # a crash instead of a clear refusal
        raise Mismatch(f"{what} should raise ValueError naming the argument, but it raised "
                       f"{type(error).__name__}: {error} ({section})") from error
    raise Mismatch(f"{what} was accepted; it must be refused with a ValueError that names the argument and "
                   f"the fix ({section})", [pitfall] if pitfall else [])


# Error messages learners meet, and what they mean. Matched against an exception's
# text when a test fails with an error rather than a wrong answer.
KNOWN_ERRORS = (
    (r"mask has unsupported dtype",
     "a mask built with `&` from a vector and a scalar condition (e.g. `(cols < HD) & (slot >= 0)`): the CPU "
     "interpreter rejects it; choose the bound with a scalar tl.where first"),
    (r"arange's range must be a power of 2|arange.*power of 2",
     "tl.arange needs a power-of-two length: round H*D (or D) up with triton.next_power_of_2 and mask the tail"),
    (r"invalid operands of type pointer<\w+> and triton\.language\.float",
     "a pointer was offset by a float: an index tensor (slot_mapping, block_table, seq_lens) of a float dtype, or an "
     "offset computed in floating point"),
    (r"misaligned address",
     "a vector load or store at an address its width does not divide: Triton vectorises a load when it believes "
     "each row starts at a multiple of the vector; with an odd row width, an offset written as one product "
     "(block * BLOCK_SIZE + pos % BLOCK_SIZE) * W can make Triton 3.6 believe it wrongly. Write it as "
     "block * (BLOCK_SIZE * W) + pos % BLOCK_SIZE * W (the same number); or a pointer offset by a wrong stride"),
    (r"illegal memory access|an illegal address",
     "the kernel read or wrote outside every tensor on the GPU: a missing mask, or an offset that wrapped around "
     "in int32 (compute offsets in int64: .to(tl.int64) on the program id, slot or block number before multiplying)"),
    # A process killed by SIGSEGV or SIGBUS (the worker's or the test process's crash message).
    (r"SIGSEGV|SIGBUS|signal 11\b|signal 7\b|[Ss]egmentation fault|[Bb]us error",
     "a read or write far outside a tensor: often an offset computed in int32 that overflowed (a slot or block "
     "number times H·D past 2**31 wraps to a negative address) — make offsets int64 (.to(tl.int64) on the program "
     "id, slot or block number before multiplying); or a load or store without its mask"),
)


def explain_error(text):
    """What a known error message means, or None."""
    return next((meaning for pattern, meaning in KNOWN_ERRORS if re.search(pattern, text)), None)


def said_error(error):
    """An exception from running the learner's code, as the learner reads it: their own
    error's type and message. tests/_worker.py brings it back as LearnerError("TypeName:
    message") or LearnerCrash(...): those names are the machinery's, never shown."""
    if isinstance(error, (LearnerError, LearnerCrash, LearnerTimeout)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def error_name(error):
    """The name of the learner's own error (a picture's cell): ModuleNotFoundError, not LearnerError."""
    if isinstance(error, LearnerError):
        return str(error).split(":", 1)[0]
    return {LearnerCrash: "crashed", LearnerTimeout: "timed out"}.get(type(error), type(error).__name__)


def describe_mistakes(drill, names):
    """One line per named pitfall, for a Mismatch message."""
    return "".join(f"\n  looks like: {drill.pitfalls[n].says} (pitfall:{n}, {drill.section})" for n in names)


def known_mistakes(drill, outcome, got):
    """(found, undecided): the pitfalls whose planted variant, run on the same input,
    produces exactly `got`, and those whose variant races on it (on a GPU: its runs
    differ, or it is known to race, `Pitfall.races`) or that ran out of time (a busy
    machine: the variants' own limit, tests/_wrong.py's LIMIT), whose mismatch is no evidence.
    `outcome(module)` runs a module on that input and returns a tuple of tensors,
    compared bit for bit. A variant that cannot run on it is no evidence."""
    found, undecided = [], []
    for name in drill.pitfalls:
        if not drill.pitfalls[name].applies(_env.INTERPRET):
            continue
        try:
            theirs = outcome(_wrong.variant(drill, name))
            # The interpreter runs programs one after another; on a GPU a race can agree with
            # itself by chance, so it gets two more runs to show itself.
            again = [] if _env.INTERPRET else [outcome(_wrong.variant(drill, name)) for _ in range(2)]
        except LearnerTimeout:  # ran out of time (a busy machine): it can neither confirm nor rule out
            undecided.append(name)
            continue
        except Exception:
            continue
        if any(_same_all(got, out) for out in (theirs, *again)):
            found.append(name)
        elif (drill.pitfalls[name].races and not _env.INTERPRET) or not all(_same_all(theirs, o) for o in again):
            undecided.append(name)
    return found, undecided


def _same_all(a, b):
    return len(a) == len(b) and all(same_bits(x.cpu(), y.cpu()) for x, y in zip(a, b))


def far_from(want, alt, atol, rtol, factor=10):
    """Elements where `alt` differs from `want` by far more than the tolerance."""
    return ~torch.isclose(alt, want, atol=factor * atol, rtol=factor * rtol)


def reproduces(got, want, alt, atol, rtol, where):
    """Rule 2 for attention: on the elements `where` (a bool mask over got's leading
    dimensions), `got` agrees with the mistake's output `alt` within tolerance, and
    there `alt` is far from the right answer `want`. False when `where` is empty."""
    if not bool(where.any()):
        return False
    close = torch.isclose(got, alt, atol=atol, rtol=rtol)
    far = far_from(want, alt, atol, rtol)
    while close.dim() > where.dim():
        close, far = close.all(dim=-1), far.any(dim=-1)
    return bool(close[where].all()) and bool(far[where].all())


def explain_token_rows(got, want, atol, rtol, explain_non_finite, explain_wrong, fmt_row, describe):
    """The shape every check of [tokens, heads, D] attention outputs shares (L3, L6):
    nothing when every (token, head) row is within tolerance; else a Mismatch whose first
    line is the finding, from `explain_non_finite(got)` when a wrong row holds NaN or inf,
    else from `explain_wrong(got, want, wrong)` (each returns (sentence, pitfall or None)),
    then the first wrong element, the wrong tokens (`fmt_row(t)`) and the case (`describe()`)."""
    wrong = ~torch.isclose(got, want, atol=atol, rtol=rtol).all(dim=-1)  # [total_q, H_q]; NaN counts as wrong
    if not wrong.any():
        return
    t, h = (int(x) for x in wrong.nonzero()[0])
    bad_rows = wrong.any(dim=1)
    if not torch.isfinite(got[bad_rows]).all():
        finding, pitfall = explain_non_finite(got)
    else:
        finding, pitfall = explain_wrong(got, want, wrong)
    err = torch.nan_to_num((got[t, h] - want[t, h]).abs(), nan=float("inf"))
    d = int(err.argmax())
    tokens = bad_rows.nonzero().flatten().tolist()
    listed = ", ".join(fmt_row(x) for x in tokens[:4]) + (", ..." if len(tokens) > 4 else "")
    raise Mismatch(
        f"{finding}\n"
        f"  first: {fmt_row(t)}, query head {h}, element {d}: expected {float(want[t, h, d]):.5g}, got "
        f"{float(got[t, h, d]):.5g} (tolerance {atol} + {rtol}·|expected|)\n"
        f"  {len(tokens)} of {len(got)} query tokens wrong: {listed}\n  {describe()}",
        [pitfall] if pitfall else [])


def output_of(out, returned, like, function, section):
    """The output tensor a check compares, once the output contract holds: `out` is the
    Guarded buffer passed as out= (checked by check_out_buffer against `returned`), or,
    for a call without out=, the tensor the function returned, which must have the shape,
    dtype and device of `like` (the query)."""
    if isinstance(out, Guarded):
        check_out_buffer(out, returned)
        return out.view
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(like.shape):
        raise Mismatch(f"{function} should return a tensor of the query's shape {tuple(like.shape)}, got "
                       f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
    if out.dtype != like.dtype or out.device != like.device:
        raise Mismatch(f"the output must have the query's dtype and device ({like.dtype}, {like.device}); got "
                       f"{out.dtype}, {out.device} ({section})")
    return out


def check_out_buffer(out, returned, what="out"):
    """The `out=` contract: the function returned `out` itself, wrote every element of
    it, and nothing before or after it. `out` is a Guarded from `poisoned_out`."""
    if returned is not out.view:
        shape = tuple(getattr(returned, "shape", ()))
        raise Mismatch(f"the function must write into {what} and return it; it returned "
                       f"{type(returned).__name__} {shape} instead")
    size = out.view.numel()
    hit_before = bits(out.storage[:out.margin]) != bits(out.initial[:out.margin])
    hit_after = bits(out.storage[out.margin + size:]) != bits(out.initial[out.margin + size:])
    if bool(hit_after.any()) or bool(hit_before.any()):
        where = []
        if bool(hit_after.any()):
            last = int(hit_after.nonzero().max()) + 1
            rows = -(-last // max(1, out.view[0].numel())) if out.view.dim() > 1 else last
            where.append(f"{int(hit_after.sum())} values were written past the end of {what} (up to {last} "
                         f"elements after it, about {rows} row{'s' * (rows > 1)})")
        if bool(hit_before.any()):
            where.append(f"{int(hit_before.sum())} values were written before the start of {what}")
        raise Mismatch(f"{'; '.join(where)}: a store without the row mask, or a row stride that is wrong")
    unwritten = never_written(out.view)
    if bool(unwritten.any()):
        idx = [int(i) for i in unwritten.nonzero()[0]]
        raise Mismatch(f"{int(unwritten.sum())} of {size} elements of {what} were never written (they still hold "
                       f"the NaN it was filled with before the call), the first at index {idx}: a store is "
                       f"missing or masked off for them")


