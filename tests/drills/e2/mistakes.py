"""Drill E2's planted mistakes: the pitfalls content/e2.md §8 names and other wrong
prefix caches, each as exact edits of solutions/e2_prefix_cache.py; PLANTED, what the
diagnosis reads of them.

E2's reference loads E1 (and the kernels) from its own folder, and a planted copy sits
in a folder of its own: every variant is also pointed at the reference folder for
them (SOLUTIONS_FOLDER below), which the variants' workers may read."""
from _drill import Mistake, Pitfall, Planted
from _tree import ROOT

SECTION = "content/e2.md §8"

# The planted copy finds E1, L1, L3 and L6 in solutions/, not beside itself.
SOLUTIONS_FOLDER = (("_HERE = os.path.dirname(os.path.abspath(__file__))", f"_HERE = {str(ROOT / 'solutions')!r}"),)


def _planted(edits):
    return SOLUTIONS_FOLDER + tuple(edits)


PITFALLS = {
    "partial_block_hashed": Pitfall(
        says="the last, partly filled block is hashed and cached under the hash of the tokens it holds so far; "
             "when it fills it never gets its full block's hash, and every later block chains from a hash "
             "nobody else computes (a later request with the same prefix misses it, or, with a lookup that also "
             "hashes partial blocks, takes a block whose tail was never written)",
        edits=_planted([("for k in range(len(hashes), len(tokens) // self.block_size):",
                         "for k in range(len(hashes), -(-len(tokens) // self.block_size)):"),
                        ("full = min(len(hashes), num_tokens // bs)", "full = min(len(hashes), -(-num_tokens // bs))")])),
    "hash_not_chained": Pitfall(
        says="each block is hashed from its own tokens only, not chained from its parent's hash: the same "
             "block_size tokens at position 0 and at position 512 (or after a different prefix) share K/V",
        edits=_planted([("hash_block_tokens(hashes[-1] if hashes else None, block)",
                         "hash_block_tokens(None, block)")])),
    "python_hash": Pitfall(
        says="the block hash is Python's hash(): hash(None) (the first block's parent) differs from process to "
             "process, str and bytes are salted per process, and an int is reduced modulo 2**61 - 1, so two "
             "parents 2**61 - 1 apart give the same chain",
        edits=_planted([("    h = NONE_HASH if parent_hash is None else parent_hash\n",
                         "    return hash((parent_hash, *token_ids)) & _MASK  # planted\n"
                         "    h = NONE_HASH if parent_hash is None else parent_hash\n")])),
    "whole_prompt_reused": Pitfall(
        says="allocate may reuse the whole prompt (a cached prompt whose length is a whole number of blocks): "
             "nothing is left to compute, so there is no row to take the first new token's logits from",
        edits=_planted([("for k, h in enumerate(hashes[:(n - 1) // bs]):", "for k, h in enumerate(hashes[:n // bs]):")])),
    "reused_not_whole_blocks": Pitfall(
        says="the reused length is capped in tokens (len(token_ids) - 1), not in whole blocks: the last prompt "
             "token is recomputed into a block other requests share, so a shared block is written",
        edits=_planted([("for k, h in enumerate(hashes[:(n - 1) // bs]):", "for k, h in enumerate(hashes[:n // bs]):"),
                        ("reused = len(hits) * bs", "reused = min(len(hits) * bs, n - 1)")])),
    "referenced_block_evicted": Pitfall(
        says="a cache hit on an evictable block does not take it out of the free queue: it counts as free while "
             "a request uses it, and is handed out (and overwritten) as a new block",
        edits=_planted([("            if self._ref[b] == 0:\n                del self._evictable[b]\n", "")])),
    "evicted_hash_kept": Pitfall(
        says="an evicted block keeps its hash and tokens: the next lookup of that hash finds it and returns "
             "whatever request now writes into it",
        edits=_planted([("            self._hash[b] = self._content[b] = None  # evicted: its hash forgotten\n", "")])),
    "hit_without_token_check": Pitfall(
        says="a hit is taken on the hash map's word alone, without checking that the block still holds this "
             "hash and these tokens: a map entry left behind by an evicted block returns another request's KV",
        edits=_planted([("if b is not None and self._hash[b] == h and self._content[b] == tuple(tokens):",
                         "if b is not None:")])),
    "preempt_keeps_refs": Pitfall(
        says="preemption takes the request off the running list without dropping its blocks' references: the "
             "blocks stay referenced for good, and with a small cache nothing can run again",
        edits=_planted([("                self.blocks.free(victim.id)\n",
                         "                for table in (self.blocks._blocks, self.blocks._tokens, self.blocks._hashes, "
                         "self.blocks._num_cached):\n                    del table[victim.id]  # planted\n")])),
    "cascade_prefix_too_long": Pitfall(
        says="the cascade prefix is not L6's rule for the batch: it reaches past what every sequence had cached "
             "before the step (or past the block-table columns every row shares), so a query attends, unmasked, "
             "to keys after it (or to another request's blocks)",
        # The learner's version of it: the cap taken from seq_lens (new tokens included).
        edits=_planted([("starts = torch.tensor([0] + [n for _, n in batch]).cumsum(0).to(torch.int32)",
                         "starts = torch.zeros(len(batch) + 1, dtype=torch.int32)")])),
}

MISTAKES = {
    "caching_always_on": Mistake(shows="enable_prefix_caching", edits=_planted([
        ("caching=enable_prefix_caching)", "caching=True)")])),
    "cascade_never_used": Mistake(shows="cascade", edits=_planted([
        ("attend = _Cascade(kernels, prefix) if prefix > 0 else kernels", "attend = kernels")])),
    "evicts_most_recent": Mistake(shows="allocate returned", edits=_planted([
        ("b = next(iter(self._evictable))", "b = next(reversed(self._evictable))")])),
    "reuse_counted_again": Mistake(shows="reused_prompt_tokens", edits=_planted([
        ("if req.id not in self.admitted:", "if True:")])),
}

PLANTED = Planted(id="e2", stem="e2_prefix_cache", section=SECTION, pitfalls=PITFALLS, mistakes=MISTAKES)
