"""Drill E1's references: `transformers` itself (greedy `generate`, and the model's own
logits along any token sequence, for the tie-robust check), and a plain-Python model of
the page's scheduling rule (content/e1.md §5), which says what each step's tensors are."""
import torch

# A token is right when its logit is within this of the model's top logit at that step
# (fp32: the engine and the model differ by ~1e-6; a wrong engine by far more). Random
# weights can leave two logits nearly tied; either choice is then right.
LOGIT_TOLERANCE = 1e-3


def reference_tokens(model, prompt, max_new):
    """What the contract asks for: model.generate's new tokens, greedy, batch of one."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device))
    return out[0, len(prompt):].tolist()


def model_logits(model, prompt, new):
    """The model's own logits (float64) for each of `new`, teacher-forced along prompt + new:
    row j is the distribution new[j] was chosen from."""
    ids = torch.tensor([list(prompt) + list(new)], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0].double().cpu()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(new)]


def eos_ids(model):
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])


def simulate(prompt_lens, new_lens, block_size, num_blocks, budget):
    """The page's scheduler and block manager, step by step, for requests whose prompts are
    prompt_lens long and that end after new_lens tokens. Returns one dict per step: rows
    [(request, first position, number of tokens)], block_table [[blocks] per row],
    preempted [requests]. Lowest free block first; the newest running request is preempted
    when a block cannot be had; waiting requests are admitted first come, first served."""
    need = [-(-(p + n - 1) // block_size) for p, n in zip(prompt_lens, new_lens)]
    num_blocks = sum(need) if num_blocks is None else num_blocks
    length = list(prompt_lens)            # tokens known (prompt + generated)
    computed, made = [0] * len(prompt_lens), [0] * len(prompt_lens)
    owned = {}                            # request -> blocks
    free = list(range(num_blocks))
    waiting, running, steps = list(range(len(prompt_lens))), [], []

    def needed(r, n):
        return -(-(computed[r] + n) // block_size) - len(owned.get(r, ()))

    def take(r, n):
        k = needed(r, n)
        owned.setdefault(r, []).extend(free[:k])
        del free[:k]

    def release(r):
        free[:] = sorted(free + owned.pop(r))

    while waiting or running:
        rows, left, preempted = [], budget, []
        for r in list(running):
            if r not in running:
                continue
            n = min(length[r] - computed[r], left)
            while needed(r, n) > len(free):
                victim = running.pop()
                release(victim)
                computed[victim] = 0
                waiting.insert(0, victim)
                preempted.append(victim)
                if victim == r:
                    break
            else:
                take(r, n)
                rows.append((r, computed[r], n))
                left -= n
        while waiting and left > 0 and not preempted:
            r = waiting[0]
            n = min(length[r], left)
            if needed(r, n) > len(free):
                break
            take(r, n)
            running.append(waiting.pop(0))
            rows.append((r, 0, n))
            left -= n
        if not rows:
            raise RuntimeError("the simulated scheduler made no progress")
        steps.append(dict(rows=rows, block_table=[list(owned[r]) for r, _, _ in rows], preempted=preempted))
        for r, start, n in rows:
            computed[r] = start + n
            if computed[r] == length[r]:
                made[r] += 1
                length[r] += 1
                if made[r] == new_lens[r]:
                    running.remove(r)
                    release(r)
    return steps


def step_tensors(step, block_size):
    """query_start_loc, seq_lens and slot_mapping of a simulated step, as lists."""
    starts, lens, slots = [0], [], []
    for (r, start, n), blocks in zip(step["rows"], step["block_table"]):
        starts.append(starts[-1] + n)
        lens.append(start + n)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    return starts, lens, slots
