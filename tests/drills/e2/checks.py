"""Drill E2's checks and their diagnosis: the block manager's replayed trace against the
plain-Python model, the hash across processes, and generate's tokens (E1's tie-robust
check), kernel calls (L1 then L3 or L6 per layer, L6's rule every step) and stats.

A pitfall is named only on evidence: seen directly (allocate returned the whole prompt,
or a length that is not whole blocks; a cascade call whose prefix breaks L6's rule), or
because the planted pitfall, run on the same input, gives exactly what the learner's
code gave while every other candidate the test exists to catch does not."""
import torch

import _wrong
from _diagnose import Mismatch
from _tree import ROOT
from _worker import LearnerCrash, LearnerError, LearnerTimeout, TreeModule
from drills.e1.checks import _returned, _tokens

from .cases import PrefixRecorder
from .mistakes import PLANTED, SECTION
from .reference import BlockManagerModel, cascade_rule

STAT_KEYS = ("prompt_tokens", "computed_prompt_tokens", "reused_prompt_tokens", "steps", "cascade_steps",
             "preemptions")


def unwritten_part(error, tree):
    """A stub under a written E2 (its E1, or the L1, L3 or L6 it runs on): E2 is not "not
    started", that part is; say which and how to go on."""
    for drill_id, stem in (("e1", "e1_paged_engine"), ("l1", "l1_paged_kv_write"), ("l3", "l3_paged_prefill"),
                           ("l6", "l6_cascade_attention")):
        if f"content/{drill_id}.md" in str(error):
            fix = ("pass E1 first: E2 builds on it (content/e2.md §1)" if drill_id == "e1" else
                   f"pass {drill_id.upper()} first, or grade E2 with the reference kernels: "
                   f"make grade DRILL=e2 KERNELS=solutions")
            raise Mismatch(f"E2 runs on your {drill_id.upper()} ({tree}/{stem}.py), which is not written yet "
                           f"({error}): {fix}")


def _named(name, problem, where):
    return Mismatch(f"{problem}\n  this is pitfall:{name} ({SECTION}): {PLANTED.pitfalls[name].says}\n  {where}", [name])


# ---------------------------------------------------------------------------
# The block manager


def replay_problem(num_blocks, block_size, ops, results):
    """(op index, what is wrong) at the first op whose result breaks the model or the
    invariants; None when the whole trace is right."""
    if not isinstance(results, list) or len(results) != len(ops):
        return 0, f"replay_prefix_cache returned {type(results).__name__}, not one result per op ({len(ops)})"
    model, rows = BlockManagerModel(num_blocks, block_size), {}
    for i, (op, got) in enumerate(zip(ops, results)):
        live_before = {s: list(t) for s, (t, _) in model.live.items()}
        want = model.apply(op)
        refused = isinstance(got, tuple) and got[:1] == ("ValueError",)
        if want == ("ValueError",) or refused:
            if want != ("ValueError",):
                return i, f"op {i} {_short(op)} was refused ({got[1] if len(got) > 1 else ''}); it fits"
            if not refused:
                return i, f"op {i} {_short(op)} must raise ValueError (changing nothing); it gave {got!r}"
            continue
        if op[0] == "allocate" and got != want:
            return i, (f"op {i} {_short(op)}: allocate returned {got!r}; the cache holds the first {want} tokens of "
                       f"this prompt in full blocks (a multiple of {block_size}, at most len - 1 = {len(op[2]) - 1})")
        if op[0] in ("num_free_blocks", "stats") and got != want:
            return i, (f"op {i} {op[0]}: {got!r}; the model says {want!r} (live sequences {sorted(live_before)}, "
                       f"{model.fresh} never-cached free blocks and {len(model.evictable)} evictable ones)")
        if op[0] == "block_table":
            problem = _table_problem(i, op[1], got, model, rows, num_blocks, block_size)
            if problem:
                return i, problem
        if op[0] == "slot_mapping":
            row = rows.get(op[1])
            expect = [row[p // block_size] * block_size + p % block_size for p in op[2]] if row else None
            if not isinstance(got, torch.Tensor) or got.dtype != torch.int64 or \
                    (expect is not None and got.tolist() != expect):
                return i, f"op {i} slot_mapping gives {got!r}; from the sequence's blocks {row} the slots are {expect}"
        if op[0] == "free":
            rows.pop(op[1], None)
    return None


def _short(op):
    return str(op) if len(str(op)) < 90 else str(op)[:87] + "...)"


def _table_problem(i, seqs, table, model, rows, num_blocks, bs):
    """E1's block-table rules, and sharing only where it is allowed: the same full, cached
    block at the same index of sequences whose tokens agree up to its end."""
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2 or \
            table.shape[0] != len(seqs):
        return f"op {i}: block_table must be an int32 tensor [len(seq_ids), width]; got {table!r}"
    where = {}
    for r, seq in enumerate(seqs):
        tokens = model.live[seq][0]
        need, row = -(-len(tokens) // bs), table[r].tolist()
        if len(row) < need or any(x != -1 for x in row[need:]) or any(not 0 <= x < num_blocks for x in row[:need]):
            return f"op {i}: sequence {seq} holds {len(tokens)} tokens: {need} blocks in 0..{num_blocks - 1}, then -1; its row is {row}"
        if row[:len(rows.get(seq, []))] != rows.get(seq, []):
            return f"op {i}: sequence {seq}'s blocks moved: {rows[seq]} became {row[:need]}"
        rows[seq] = row[:need]
        for k, block in enumerate(row[:need]):
            if block in where:
                other, j = where[block]
                full = (k + 1) * bs <= len(tokens) and (j + 1) * bs <= len(model.live[other][0])
                if k != j or not full or model.live[other][0][:(k + 1) * bs] != tokens[:(k + 1) * bs]:
                    return (f"op {i}: block {block} is block {j} of sequence {other} and block {k} of sequence {seq}: "
                            f"only a full block with the same tokens before it, at the same place, may be shared "
                            f"(a block still in use was handed out again, or a shared block is written)")
            where[block] = (seq, k)
    return None


def check_replay(num_blocks, block_size, ops, results, candidates=(), variants=None):
    """The replayed trace against the model; when wrong, a Mismatch that names a pitfall seen
    directly, or the one candidate whose planted variant gives exactly these results."""
    found = replay_problem(num_blocks, block_size, ops, results)
    if found is None:
        return
    i, problem = found
    where = f"trace (num_blocks={num_blocks}, block_size={block_size}): {_short(ops)}"
    op, got = ops[i], results[i] if isinstance(results, list) and i < len(results) else None
    if op[0] == "allocate" and isinstance(got, int):
        if got >= len(op[2]):
            raise _named("whole_prompt_reused", problem, where)
        if got % block_size:
            raise _named("reused_not_whole_blocks", problem, where)
    agree = [name for name in candidates if _same(_variant_replay(name, num_blocks, block_size, ops), results)]
    if len(agree) == 1:
        raise _named(agree[0], problem, where)
    raise Mismatch(f"{problem}\n  {where}")


def variant(name):
    """The reference with pitfall `name` planted, in the variants' worker (tests/_wrong.py). Planted
    here, one folder down: a worker run as an unprivileged user cannot read a folder that is
    itself private (mkdtemp's 0700), only what the sandbox exposes under it."""
    where = _wrong.folder() / "e2" / name
    if not (where / f"{PLANTED.stem}.py").exists():
        _wrong.plant(PLANTED, name, where)
    _wrong._VARIANTS.prepare(readable=[where.parent, ROOT / "solutions"], preload=("drills.e2.cases",))
    return TreeModule(where, PLANTED.stem, _wrong._VARIANTS)


def _variant_replay(name, num_blocks, block_size, ops):
    try:
        return variant(name).replay_prefix_cache(num_blocks, block_size, ops)
    except Exception:  # noqa: BLE001 -- a variant that fails agrees with nothing
        return None


def _same(a, b):
    """Equal as the model sees them: every result but block tables and slots (their numbers
    may differ between right answers)."""
    if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
        return False
    return all(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) or
               (x[:1] == y[:1] if isinstance(x, tuple) and isinstance(y, tuple) else x == y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------
# The engine


def run_generate(drill, case, kernels, expect=None, candidates=()):
    """generate(..., return_stats=True) of the learner's engine on the case, through a
    PrefixRecorder on `kernels`; every failure explained. `candidates`: the engine pitfalls
    the case exists to catch, whose planted variants are run on it when the learner's run
    raised (a stall, a refusal). Returns (tokens, stats, recorder)."""
    rec = PrefixRecorder(kernels)
    error = result = None
    try:
        result = drill.generate(case.model, case.prompts, case.max_new, **case.kwargs(), kernels=rec,
                                return_stats=True)
    except NotImplementedError as e:
        unwritten_part(e, kernels)
        raise
    except (LearnerTimeout, LearnerCrash, Exception) as e:  # explained below
        error = e
    tokens, stats = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    problem, named = engine_problem(case, tokens, stats, rec.calls(), error, expect)
    if problem is None:
        return tokens, stats, rec
    if named is None and candidates and error is not None and _reference_runs(case):
        # The candidates' evidence is how a run ends, and only where the reference runs the
        # case: where it fails too (a machine whose Triton cannot start, say), every planted
        # variant fails the same way and singles out nothing.
        agree = [name for name in candidates if _variant_gives(name, case, tokens, stats, error)]
        named = agree[0] if len(agree) == 1 else None
    lines = [problem] + ([f"  this is pitfall:{named} ({SECTION}): {PLANTED.pitfalls[named].says}"] if named else [])
    raise Mismatch("\n".join(lines + [f"  {case.describe()}"]), [named] if named else [])


def _error_kind(error):
    """What kind of failure ended a run: a timeout, a crash, or the type the code raised
    (a LearnerError's message starts with it)."""
    if isinstance(error, LearnerError):
        return str(error).partition(":")[0]
    return type(error).__name__


def _generate(module, case):
    return module.generate(case.model, case.prompts, case.max_new, **case.kwargs(),
                           kernels=PrefixRecorder(ROOT / "solutions"), return_stats=True)


def _reference_runs(case):
    """Whether the reference runs the case to its end in the variants' worker."""
    _wrong._VARIANTS.prepare(readable=[ROOT / "solutions"], preload=("drills.e2.cases",))
    try:
        _generate(TreeModule(ROOT / "solutions", PLANTED.stem, _wrong._VARIANTS), case)
    except Exception:  # noqa: BLE001 -- any failure: the case says nothing here
        return False
    return True


def _variant_gives(name, case, tokens, stats, error):
    try:
        theirs = _generate(variant(name), case)
    except Exception as e:  # noqa: BLE001 -- the variant's own failure is the evidence
        return error is not None and _error_kind(e) == _error_kind(error)
    return error is None and list(theirs) == [tokens, stats]


def engine_problem(case, tokens, stats, calls, error=None, expect=None):
    """(what is wrong, pitfall seen directly or None), or (None, None)."""
    steps, problem = _steps(case, calls)
    if problem:
        return problem
    if error is None and len(calls) % (2 * case.model.config.num_hidden_layers):
        return "the kernel calls end part-way through a step (content/e2.md §5)", None
    if error is not None:
        return f"generate raised {type(error).__name__}: {error}", None
    if not isinstance(stats, dict) or sorted(stats) != sorted(STAT_KEYS) or \
            not all(isinstance(v, int) for v in stats.values()):
        return (f"generate(..., return_stats=True) must return (tokens, stats), stats a dict of ints with the keys "
                f"{list(STAT_KEYS)}; got {str(stats)[:120]} (content/e2.md §6)"), None
    said = _returned(case, tokens) or _tokens(case, tokens)
    if said:
        return said, None
    return _stats_problem(case, stats, steps, expect), None


def _steps(case, calls):
    """([(kind, prefix, rule)] per step, None), or (None, (the first problem, a pitfall seen
    directly or None)). A step cut short by an error is still read up to its attention call."""
    layers, bs = case.model.config.num_hidden_layers, case.block_size
    steps = []
    for s, first in enumerate(range(0, len(calls), 2 * layers)):
        group = calls[first:first + 2 * layers]
        if any(c[0] != "L1" for c in group[0::2]) or any(c[0] == "L1" for c in group[1::2]):
            return None, (f"step {s}: the kernel calls are not one L1 call, then one attention call (L3 or L6's "
                          f"cascade_attention), per layer, for the whole batch (content/e2.md §5)", None)
        if len(group) < 2:
            break
        kind, starts, lens, table, prefix = group[1]
        rule = cascade_rule(table, starts, lens, bs)
        if kind == "L6" and prefix > rule:
            cached = min(l - (b - a) for l, a, b in zip(lens, starts, starts[1:]))
            return None, (f"step {s}: cascade_attention with common_prefix_len = {prefix}, but L6's rule gives {rule} "
                          f"for this batch (block tables {table}, seq_lens {lens}, query_start_loc {starts}; the "
                          f"fewest tokens cached before the step: {cached})", "cascade_prefix_too_long")
        if len(group) < 2 * layers:
            break  # cut short: an error the caller reports
        if any(c != group[1] for c in group[1::2]):
            return None, (f"step {s}: the layers did not all attend the same way (kernel, metadata, prefix)", None)
        if starts[-1] > case.budget:
            return None, (f"step {s} holds {starts[-1]} tokens, more than max_num_batched_tokens = {case.budget}",
                          None)
        if (kind == "L6") != (rule > 0) or (kind == "L6" and prefix != rule):
            return None, (f"step {s}: L6's cascade_prefix_len gives {rule} for this batch, but the step attended through "
                          + (f"cascade_attention with common_prefix_len = {prefix}" if kind == "L6" else "L3")
                          + ": every step with a shared prefix goes through cascade with L6's length, every other "
                            "through L3 (content/e2.md §5)", None)
        if kind == "L6" and not case.caching:
            return None, (f"step {s} went through cascade with enable_prefix_caching=False: with caching off "
                          f"nothing is shared", None)
        steps.append((kind, prefix, rule))
    return steps, None


def _stats_problem(case, stats, steps, expect):
    prompt = sum(map(len, case.prompts))
    cascade = sum(kind == "L6" for kind, _, _ in steps)
    wrong = []
    if stats["prompt_tokens"] != prompt:
        wrong.append(f"prompt_tokens is {stats['prompt_tokens']}, the prompts hold {prompt}")
    if stats["computed_prompt_tokens"] + stats["reused_prompt_tokens"] != prompt:
        wrong.append(f"computed_prompt_tokens + reused_prompt_tokens = {stats['computed_prompt_tokens']} + "
                     f"{stats['reused_prompt_tokens']}, not the {prompt} prompt tokens: each counts once, at its "
                     f"first admission (a preempted request's recompute is not counted again)")
    if stats["reused_prompt_tokens"] % case.block_size:
        wrong.append(f"reused_prompt_tokens {stats['reused_prompt_tokens']} is not whole blocks of {case.block_size}")
    if not case.caching and stats["reused_prompt_tokens"]:
        wrong.append(f"reused {stats['reused_prompt_tokens']} prompt tokens with enable_prefix_caching=False")
    if (stats["steps"], stats["cascade_steps"]) != (len(steps), cascade):
        wrong.append(f"steps, cascade_steps = {stats['steps']}, {stats['cascade_steps']}; the kernels saw {len(steps)} "
                     f"steps, {cascade} of them through cascade")
    for key, value in (expect or {}).items():
        if stats[key] != value:
            wrong.append(f"{key} is {stats[key]}; this case gives {value}")
    if not wrong:
        return None
    return f"generate's stats {stats}: " + "; ".join(wrong) + " (content/e2.md §6)"
