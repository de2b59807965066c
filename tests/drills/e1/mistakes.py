"""Drill E1's planted mistakes: the pitfalls content/e1.md §9 names and other wrong
engines, each as exact edits of solutions/e1_paged_engine.py; PLANTED, what the
diagnosis reads of them."""
from _drill import Mistake, Pitfall, Planted

SECTION = "content/e1.md §9"

PITFALLS = {
    "rope_batch_index": Pitfall(
        says="RoPE is applied at each token's row in the flattened batch instead of at its position in its sequence",
        edits=(("inner.rotary_emb(h, step.positions[None])",
                "inner.rotary_emb(h, torch.arange(len(step.ids), device=step.ids.device)[None])"),)),
    "chunk_positions_restart": Pitfall(
        says="every chunk's positions restart at 0 (a later prompt chunk, and a decode, are rotated as if the "
             "sequence began with them), though its K/V go to the right slots",
        edits=(("        positions += pos\n", "        positions += range(n)\n"),)),
    "blocks_not_freed": Pitfall(
        says="a finished request's blocks are never returned to the free list, so with a small cache the waiting "
             "requests never get any",
        edits=(("        self.blocks.free(req.id)  # at once", "        pass  # planted: blocks not freed; at once"),)),
    "block_shared": Pitfall(
        says="blocks handed out stay on the free list (freed while still in use), so a second live sequence is "
             "given the same block and overwrites the first one's K/V",
        edits=(("        del self._free[:need]\n", ""),),
        # Two live sequences then write the same slots in one L1 launch: on a GPU in no fixed order.
        races=True),
    "kv_prev_slot": Pitfall(
        says="K/V are written one position early, into the previous token's slot (slot - 1, or position - 1's "
             "slot)",
        # The page's example: the position computed from the new length minus one.
        edits=(("slots.append(blocks.slot_mapping(req.id, list(pos)))",
                "slots.append(blocks.slot_mapping(req.id, [p - 1 for p in pos]))"),)),
    "sample_wrong_row": Pitfall(
        says="the next token is sampled from the first row of each sequence's chunk, not its last",
        edits=(("last=starts[1:] - 1)", "last=starts[:-1])"),)),
    "seq_lens_without_new": Pitfall(
        says="seq_lens counts the tokens already in the cache but not this step's new ones",
        edits=(("seq_lens.append(req.computed + n)", "seq_lens.append(req.computed)"),)),
}

MISTAKES = {
    "eos_ignored": Mistake(shows="past EOS", edits=(
        ("if token in eos or len(req.new) == req.max_new:", "if len(req.new) == req.max_new:"),)),
    "budget_ignored": Mistake(shows="max_num_batched_tokens", edits=(
        ("n = min(len(req.tokens), left)", "n = len(req.tokens)"),)),
    # Never preempts: a running request that finds no free block sits the step out. With
    # room for all but one it passes; when every running request needs a block at once,
    # nothing runs again (issue 36: it passed 17/17).
    "running_request_skipped": Mistake(shows="preempts", edits=(
        ("                victim = self.running.pop()  # the newest",
         "                break  # planted: skipped this step, nobody preempted\n"
         "                victim = self.running.pop()  # the newest"),)),
}

PLANTED = Planted(id="e1", stem="e1_paged_engine", section=SECTION, pitfalls=PITFALLS, mistakes=MISTAKES)
