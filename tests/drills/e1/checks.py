"""Drill E1's checks and their diagnosis, in the engine's terms: which request, which
chunk, which step, which position, slot or block is wrong. The tokens are checked
against `transformers` (tie-robust: each token must be the model's top choice within
LOGIT_TOLERANCE along the engine's own sequence); the kernel calls against the
contract; and a wrong answer is explained from what the instrumented kernels saw."""
import torch

import _wrong
from _diagnose import Mismatch
from _tree import ROOT
from _worker import LearnerCrash, LearnerTimeout

from .cases import Recorder
from .mistakes import PLANTED, SECTION
from .reference import LOGIT_TOLERANCE, eos_ids, model_logits, step_tensors

# Pitfalls seen directly in what the engine passed to the kernels (the Recorder's log), not
# inferred from its output: named without the planted variant's tokens to agree (for
# kv_prev_slot they need not: slot - 1 and position - 1's slot part at a block's start).
SEEN_DIRECTLY = {"kv_prev_slot"}
ORDINAL = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]


def run_generate(drill, case, kernels, rec=None, after=None):
    """generate() of the learner's engine on the case, through a Recorder on `kernels`;
    every failure explained (check_generate). `after()` runs between the call and the
    check. Returns (tokens, recorder)."""
    rec = rec or Recorder(kernels)
    error, got = None, None
    try:
        got = drill.generate(case.model, case.prompts, case.max_new, **case.kwargs(), kernels=rec)
    except (LearnerTimeout, LearnerCrash, Exception) as e:  # explained below, outside this handler
        error = e
    if after:
        after()
    if isinstance(error, NotImplementedError):
        unwritten_kernel(error, kernels)
        raise error
    check_generate(case, got, rec, error, drill=drill, kernels=kernels)
    return got, rec


def unwritten_kernel(error, kernels):
    """A stub kernel under a written engine: E1 is not 'not started', L1 or L3 is."""
    for drill_id, stem in (("l1", "l1_paged_kv_write"), ("l3", "l3_paged_prefill")):
        if f"content/{drill_id}.md" in str(error):
            raise Mismatch(f"E1 runs on your {drill_id.upper()} ({kernels}/{stem}.py), which is not written yet "
                           f"({error}): pass {drill_id.upper()} first, or grade E1 with the reference kernels: "
                           f"make grade DRILL=e1 KERNELS=solutions")


def check_generate(case, got, rec, error=None, *, drill=None, kernels=None):
    """The whole check of one generate() call: what it returned (or raised), the kernel
    calls it made, and, when wrong, why."""
    calls = rec.calls()
    problem = _structure(case, calls) if error is None else None
    if error is None and problem is None:
        problem = _returned(case, got) or _tokens(case, got)
        if problem is None:
            return
    elif error is not None:
        problem = f"generate raised {type(error).__name__}: {error}"
    if error is None and any(s in problem for s in ("past EOS", "stopped after", "more than its max_new")):
        findings, candidate = [], None  # when to stop, not what to compute: the kernels saw nothing wrong
    else:
        findings, candidate = explain(case, calls, got)
    named = candidate if candidate and (candidate in SEEN_DIRECTLY or
                                        _variant_agrees(case, candidate, got, findings, error)) else None
    blame = None if named else _blame_kernels(drill, case, kernels)
    lines = [blame or problem]
    if blame:  # what the engine's tensors look like is beside the point then
        lines.append(f"  what it found with your kernels: {problem}")
    else:
        lines += [f"  {f}" for f in findings[:4]]
    if named:
        lines.append(f"  this is pitfall:{named} ({SECTION}): {PLANTED.pitfalls[named].says}")
    lines.append(f"  {case.describe()}")
    raise Mismatch("\n".join(lines), [named] if named else [])


def check_tokens(case, got):
    """The tokens alone (for a call made without a Recorder)."""
    problem = _returned(case, got) or _tokens(case, got)
    if problem:
        raise Mismatch(f"{problem}\n  {case.describe()}")


def check_schedule(case, rec):
    """The worked example (content/e1.md §3): each step's chunks, query_start_loc and
    seq_lens are the page's; each row's slots follow its own block table."""
    expected, bs = case.schedule(), case.block_size
    steps = steps_of(case, rec.calls())
    if len(steps) != len(expected):
        raise Mismatch(f"the engine ran {len(steps)} steps; the page's schedule (content/e1.md §3) runs "
                       f"{len(expected)}\n  {case.describe()}")
    for s, ((slots, _, starts, lens, table), want) in enumerate(zip(steps, expected)):
        want_starts, want_lens, _ = step_tensors(want, bs)
        if (starts, lens) != (want_starts, want_lens):
            raise Mismatch(f"step {s}: query_start_loc {starts}, seq_lens {lens}; the page's table (content/e1.md §3) "
                           f"has {want_starts}, {want_lens}\n  {case.describe()}")
        own = [table[b][p // bs] * bs + p % bs for b, (_, start, n) in enumerate(want["rows"])
               for p in range(start, start + n)]
        if slots != own:
            raise Mismatch(f"step {s}: slot_mapping {slots}, but the block table {table} puts these positions at "
                           f"{own}\n  {case.describe()}")


def _returned(case, got):
    if not isinstance(got, list) or len(got) != len(case.prompts) or \
            not all(isinstance(t, list) and all(isinstance(x, int) for x in t) for t in got):
        return (f"generate must return one list of int token ids per prompt ({len(case.prompts)}); got "
                f"{type(got).__name__} {str(got)[:80]} (content/e1.md §1)")
    return None


def _tokens(case, got):
    """Each new token must be the model's top choice (within LOGIT_TOLERANCE) given the tokens
    before it; the request stops at EOS or after max_new_tokens, as model.generate does."""
    eos = eos_ids(case.model)
    for r, (prompt, new, n) in enumerate(zip(case.prompts, got, case.max_new)):
        if len(new) > n:
            return f"request {r} made {len(new)} new tokens, more than its max_new_tokens = {n}"
        stop = next((j for j, t in enumerate(new) if t in eos), None)
        if stop is not None and stop < len(new) - 1:
            return (f"request {r} went on past EOS: new token {stop} is the EOS token {new[stop]}, and "
                    f"{len(new) - stop - 1} more followed; a request ends at EOS (content/e1.md §5)")
        if not new:
            return f"request {r} made no token at all"
        logits = model_logits(case.model, prompt, new)
        for j, token in enumerate(new):
            top, best = float(logits[j].max()), int(logits[j].argmax())
            if float(logits[j, token]) < top - LOGIT_TOLERANCE:
                return (f"request {r}, new token {j} (sampled after position {len(prompt) + j - 1}): the engine chose "
                        f"token {token}, whose logit under the model is {top - float(logits[j, token]):.3g} below the "
                        f"top (token {best}, the model's greedy choice); transformers' generate gives "
                        f"{case.reference()[r]}, the engine {new}")
        if len(new) < n and new[-1] not in eos:
            return (f"request {r} stopped after {len(new)} new tokens, before max_new_tokens = {n} and with no EOS; "
                    f"transformers' generate gives {case.reference()[r]}")
    return None


def _structure(case, calls):
    """One L1 then one L3 call per layer per step, for the whole batch; each step within the
    budget; the same metadata in every layer."""
    layers = case.model.config.num_hidden_layers
    kinds = [c[0] for c in calls]
    if not calls:
        return "generate called neither L1's reshape_and_cache nor L3's paged_prefill_attention (content/e1.md §7)"
    for i, kind in enumerate(kinds):
        if kind != ("L1", "L3")[i % 2]:
            return (f"kernel call {i} (step {i // (2 * layers)}, layer {i % (2 * layers) // 2}) is {kind}; every "
                    f"layer makes one L1 call (write this step's K/V) and then one L3 call (attend), for the whole "
                    f"batch (content/e1.md §7)")
    if len(calls) % (2 * layers):
        return (f"{len(calls)} kernel calls are not a whole number of steps of {layers} layers x (L1 + L3): one call "
                f"of each per layer per step, for the whole batch (content/e1.md §7)")
    for s in range(len(calls) // (2 * layers)):
        step = calls[2 * layers * s:2 * layers * (s + 1)]
        if any(c[1:] != step[1][1:] for c in step[1::2]) or any(c[1] != step[0][1] for c in step[0::2]):
            return f"step {s}: the layers did not all get the same slot_mapping and L3 metadata"
        if step[1][1][-1] > case.budget:
            return (f"step {s} holds {step[1][1][-1]} tokens, more than max_num_batched_tokens = {case.budget} "
                    f"(content/e1.md §5)")
    return None


# ---------------------------------------------------------------------------
# The explanation, from what the kernels saw


def steps_of(case, calls):
    """Layer 0's view of each step: (slots, keys, query_start_loc, seq_lens, block_table)."""
    layers = case.model.config.num_hidden_layers
    out = []
    for s in range(0, len(calls) - 1, 2 * layers):
        (k1, slots, keys), l3 = calls[s], calls[s + 1]
        if k1 != "L1" or l3[0] != "L3":
            break
        out.append((slots, keys, *l3[1:]))
    return out


def _rotary_table(model, max_pos):
    x = torch.zeros(1, max_pos, model.config.hidden_size, device=model.device)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x, torch.arange(max_pos, device=model.device)[None])
    return cos[0].cpu(), sin[0].cpu()


def _pre_rope_keys(model, tokens):
    inner, attn = model.model, model.model.layers[0].self_attn
    with torch.no_grad():
        k = attn.k_proj(inner.layers[0].input_layernorm(inner.embed_tokens(torch.tensor(tokens, device=model.device))))
    return k.view(len(tokens), -1, attn.head_dim).cpu()


def _rotated_as(model, key, token, cos, sin):
    """The position whose rotation of `token`'s layer-0 key gives `key` (None: none does)."""
    k = _pre_rope_keys(model, [token])[0]
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    every = k[None] * cos[:, None] + rotated[None] * sin[:, None]          # [P, H, D]
    err = (every - key[None]).abs().amax(dim=(1, 2))
    best = int(err.argmin())
    return best if float(err[best]) < 1e-3 else None


def explain(case, calls, got):
    """(findings, candidate pitfall or None): what the kernels saw that is wrong, said in
    the engine's terms, step by step, against the page's schedule for this case."""
    steps = steps_of(case, calls)
    expected = case.schedule([len(t) for t in got] if isinstance(got, list) and got and
                             all(isinstance(t, list) and t for t in got) and len(got) == len(case.prompts) else None)
    bs = case.block_size
    tokens = [list(p) + list(t) for p, t in zip(case.prompts, got)] if isinstance(got, list) and \
        len(got) == len(case.prompts) else [list(p) + list(r) for p, r in zip(case.prompts, case.reference())]
    cos, sin = _rotary_table(case.model, max(len(t) for t in tokens) + 8)
    seen = [0] * len(case.prompts)  # chunks of each request so far
    for s, ((slots, keys, starts, lens, table), want) in enumerate(zip(steps, expected)):
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        if q_lens != [n for _, _, n in want["rows"]]:
            return ([f"step {s} holds chunks of {q_lens} tokens; the page's schedule (content/e1.md §5) gives "
                     f"{[n for _, _, n in want['rows']]} for requests {[r for r, _, _ in want['rows']]}"], None)
        findings, candidate = _step_findings(case, s, slots, keys, starts, lens, table, want, tokens, seen, cos, sin)
        if findings:
            return findings, candidate
        for r, _, _ in want["rows"]:
            seen[r] += 1
    if len(steps) < len(expected):
        left = sorted({r for st in expected[len(steps):] for r, _, _ in st["rows"]})
        done = [r for r in range(len(case.prompts)) if r not in left]
        findings = [f"the engine stopped after {len(steps)} steps of the {len(expected)} the page's schedule runs; "
                    f"requests {left} never finished"
                    + (f" while requests {done} had finished and left the cache: were their blocks freed?" if done
                       else "")]
        victims = expected[len(steps)]["preempted"]
        if victims:  # what the page's scheduler does at the step the engine did not run
            findings.append(f"at step {len(steps)} the running requests need more blocks than are free: the page's "
                            f"scheduler preempts the newest (requests {victims}: their blocks freed, recomputed "
                            f"later) until request {expected[len(steps)]['rows'][0][0]} fits (content/e1.md §5)")
        return findings, "blocks_not_freed" if done else None
    if not isinstance(got, list):
        return [], None
    said = _sampling(case, got, expected)
    return said, ("sample_wrong_row" if "first row of its last prompt chunk" in said[0] else None)


def _step_findings(case, s, slots, keys, starts, lens, table, want, tokens, seen, cos, sin):
    bs = case.block_size
    _, want_lens, _ = step_tensors(want, bs)
    if lens != want_lens:
        short = all(l == w - (b - a) for l, w, a, b in zip(lens, want_lens, starts, starts[1:]) if l != w)
        return ([f"step {s}: seq_lens {lens}, but the contexts, this step's new tokens included, are {want_lens}"
                 + (": seq_lens counts the cache without the new tokens" if short else "")],
                "seq_lens_without_new" if short else None)
    live = {}
    for b, (row, n) in enumerate(zip(table, lens)):
        for block in row[:-(-n // bs)]:
            if block in live and live[block] != b:
                r1, r2 = want["rows"][live[block]][0], want["rows"][b][0]
                return ([f"step {s}: block {block} is in request {r1}'s and request {r2}'s block tables at once: a "
                         f"block was handed out while still in use"], "block_shared")
            live[block] = b
    findings, rope, restart, prev = [], [], [], []
    for b, (r, start, n) in enumerate(want["rows"]):
        chunk = ("decode" if start >= len(case.prompts[r]) else f"{ORDINAL[min(seen[r], 7)]} chunk")
        for i in range(n):
            t, pos = starts[b] + i, start + i
            own = table[b][pos // bs] * bs + pos % bs
            if slots[t] != own:
                owned = table[b][:-(-lens[b] // bs)]
                prev.append(slots[t] in _one_position_early(owned, pos, bs))
                findings.append(f"request {r}'s {chunk} (step {s}): the K/V of position {pos} went to slot {slots[t]}, "
                                f"not its own slot {own} (block {table[b][pos // bs]}, offset {pos % bs})"
                                + (f": position {pos - 1}'s" if pos and slots[t] == _slot(owned, pos - 1, bs) else ""))
                continue
            q = _rotated_as(case.model, keys[t], tokens[r][pos], cos, sin)
            if q != pos:
                rope.append(q == t)
                restart.append(q == i)
                findings.append(f"request {r}'s {chunk} (step {s}): position {pos} was rotated as "
                                + (f"position {q}" if q is not None else "no position at all (not this token's key)"))
    if not findings:
        return [], None
    if prev and all(prev):
        return findings, "kv_prev_slot"
    if rope and not prev:
        if all(rope) and not all(restart):
            return findings + ["each wrong position was rotated as its row's index in the batch"], "rope_batch_index"
        if all(restart) and not all(rope):
            return findings + ["each wrong position was rotated as its index in its chunk, as if the chunk "
                               "started at 0"], "chunk_positions_restart"
    return findings, None


def _one_position_early(blocks, pos, bs):
    """The slots the K/V of position `pos` lands in when written one position early
    (pitfall:kv_prev_slot, content/e1.md §9), for a sequence owning `blocks`: one slot
    early, or position pos - 1's slot (they part at a block's start; at position 0,
    position -1's slot is where Python's floor division and negative index lead: the last
    slot of the sequence's last block)."""
    return {_slot(blocks, pos, bs) - 1, _slot(blocks, pos - 1, bs)}


def _slot(blocks, pos, bs):
    return blocks[pos // bs] * bs + pos % bs


def _sampling(case, got, expected):
    """Every step's tensors are right: the tokens come from the wrong rows, or elsewhere."""
    if not isinstance(got, list):
        return []
    out = []
    for r, (prompt, new) in enumerate(zip(case.prompts, got)):
        first = _first_row_prediction(case, r, expected)
        if new and first is not None and new[0] == first[1] != case.reference()[r][0]:
            out.append(f"request {r}'s first new token {new[0]} is the model's prediction after position {first[0]}, "
                       f"the first row of its last prompt chunk, not after position {len(prompt) - 1}, its last row")
    return out or ["every step's slot_mapping, seq_lens, block tables and rotated keys are right; look at what "
                   "happens after the kernels: the MLP, the final norm, lm_head and which row is sampled"]


def _first_row_prediction(case, r, expected):
    prompt = case.prompts[r]
    last = [start for st in expected for q, start, n in st["rows"] if q == r and start + n == len(prompt)]
    if not last or last[0] == len(prompt) - 1:
        return None
    with torch.no_grad():
        logits = case.model(torch.tensor([prompt], device=case.model.device)).logits[0]
    return last[0], int(logits[last[0]].argmax())


# ---------------------------------------------------------------------------
# Naming only on evidence, and blaming the kernels when they are at fault


def _variant_agrees(case, name, got, findings, error):
    """The planted pitfall, run on the same case (on the reference kernels), fails the same
    way: the same tokens (or an error where the learner's engine had one) and the same
    first finding."""
    rec = Recorder(ROOT / "solutions")
    theirs, their_error = None, None
    try:
        theirs = _wrong.variant(PLANTED, name).generate(case.model, case.prompts, case.max_new, **case.kwargs(),
                                                        kernels=rec)
    except Exception as e:  # noqa: BLE001 -- the variant's own failure is the evidence
        their_error = e
    if (error is None) != (their_error is None) or (error is None and theirs != got):
        return False
    their_findings, their_candidate = explain(case, rec.calls(), theirs if theirs is not None else got)
    return their_candidate == name and their_findings[:1] == findings[:1]


def _blame_kernels(drill, case, kernels):
    """The engine on the reference L1 and L3: if it is right there, the learner's kernels are
    at fault; say which one."""
    solutions = str(ROOT / "solutions")
    if drill is None or kernels is None or str(kernels) == solutions:
        return None

    def right_with(l1, l3):
        rec = Recorder(l1, l3)
        try:
            got = drill.generate(case.model, case.prompts, case.max_new, **case.kwargs(), kernels=rec)
        except Exception:  # noqa: BLE001
            return False
        return _structure(case, rec.calls()) is None and _returned(case, got) is None and _tokens(case, got) is None

    if not right_with(solutions, solutions):
        return None
    bad = [name for name, l1, l3 in (("L1", kernels, solutions), ("L3", solutions, kernels)) if not right_with(l1, l3)]
    which = " and ".join(bad) or "L1 and L3 together"
    return (f"E1 runs on your {which} ({kernels}), and with the reference kernels in their place your engine gives "
            f"the model's tokens: pass {which} first (make grade DRILL={bad[0].lower() if bad else 'l1'}), or grade "
            f"E1 with the reference kernels: make grade DRILL=e1 KERNELS=solutions")


# ---------------------------------------------------------------------------
# The block manager


def check_block_manager(num_blocks, block_size, ops, results):
    """What replay_block_manager gave for `ops`, against the contract: a sequence of n tokens
    owns ceil(n / block_size) blocks, no block is owned twice, its blocks keep their place
    as it grows, -1 pads its row, slots follow its blocks, freed blocks come back, and a
    request larger than the whole cache is refused."""
    if not isinstance(results, list) or len(results) != len(ops):
        raise Mismatch(f"replay_block_manager returned {type(results).__name__}, not one result per op ({len(ops)})")
    tokens, rows = {}, {}
    for i, (op, result) in enumerate(zip(ops, results)):
        where = f"op {i} {op[:2]} (num_blocks={num_blocks}, block_size={block_size})"
        refused = isinstance(result, tuple) and result[:1] == ("ValueError",)
        if op[0] == "allocate" and op[2] > num_blocks * block_size:
            if not refused:
                raise Mismatch(f"{where}: {op[2]} tokens is more than the whole cache holds "
                               f"({num_blocks * block_size}); allocate must raise ValueError (content/e1.md §4)")
            continue
        if refused:
            raise Mismatch(f"{where} fits in the free blocks but was refused: {result[1]}")
        if op[0] == "allocate":
            tokens[op[1]] = op[2]
        elif op[0] == "append":
            tokens[op[1]] += op[2]
        elif op[0] == "free":
            del tokens[op[1]]
            rows.pop(op[1], None)
        elif op[0] == "num_free_blocks":
            owned = sum(-(-n // block_size) for n in tokens.values())
            if result != num_blocks - owned:
                raise Mismatch(f"{where}: num_free_blocks is {result}; {owned} of {num_blocks} blocks are owned by "
                               f"live sequences {sorted(tokens)}, so {num_blocks - owned} are free"
                               + (" (a freed sequence's blocks did not come back?)" if result < num_blocks - owned
                                  else ""))
        elif op[0] == "block_table":
            _check_table(where, op[1], result, tokens, rows, num_blocks, block_size)
        elif op[0] == "slot_mapping":
            row = rows.get(op[1])
            want = [row[p // block_size] * block_size + p % block_size for p in op[2]] if row else None
            if not isinstance(result, torch.Tensor) or result.dtype != torch.int64 or \
                    (want is not None and result.tolist() != want):
                raise Mismatch(f"{where}: slot_mapping gives {result!r}; from the sequence's blocks {row} the slots "
                               f"are {want} (an int64 tensor: block * block_size + position % block_size)")


def _check_table(where, seq_ids, table, tokens, rows, num_blocks, block_size):
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2 or \
            table.shape[0] != len(seq_ids):
        raise Mismatch(f"{where}: block_table must be an int32 tensor [len(seq_ids), max_blocks]; got {table!r}")
    owner = {}
    for b, seq in enumerate(seq_ids):
        need = -(-tokens[seq] // block_size)
        row = table[b].tolist()
        if len(row) < need or any(x != -1 for x in row[need:]):
            raise Mismatch(f"{where}: sequence {seq} holds {tokens[seq]} tokens, so exactly {need} blocks then -1; "
                           f"its row is {row}")
        blocks = row[:need]
        if any(not 0 <= x < num_blocks for x in blocks):
            raise Mismatch(f"{where}: sequence {seq}'s row {row} names blocks outside 0..{num_blocks - 1}")
        before = rows.get(seq, [])
        if blocks[:len(before)] != before:
            raise Mismatch(f"{where}: sequence {seq}'s blocks moved as it grew: {before} became {blocks}; a "
                           f"sequence's blocks keep their place (its cached K/V live there)")
        for x in blocks:
            if x in owner:
                raise Mismatch(f"{where}: block {x} belongs to sequence {owner[x]} and sequence {seq} at once: a "
                               f"block still in use was handed out again")
            owner[x] = seq
        rows[seq] = blocks
