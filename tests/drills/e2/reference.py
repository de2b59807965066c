"""Drill E2's references: a plain-Python model of the prefix-caching block manager
(content/e2.md §3), which says what every replayed op must give; L6's cascade rule on
plain lists (which prefix a step may read once); and the fingerprint of Python's
hash() on ints. The tokens themselves are checked against transformers (E1's reference)."""

MERSENNE = 2**61 - 1  # Python's hash() of an int is the int modulo this prime (for ints >= 0)


class BlockManagerModel:
    """What a PrefixCachingBlockManager must answer, op by op. A block is named by its
    chain key: the tuple of every token up to its end (what a chained hash stands for,
    without the hash). Which physical block is which is not modelled: the checks compare
    what allocate returns, num_free_blocks and stats, and check block tables for their
    invariants. An allocated prompt counts as computed at once (replay_prefix_cache)."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.fresh = num_blocks    # free blocks that hold no cached block
        self.evictable = {}        # chain key -> None, least recently freed first
        self.cached = {}           # chain key -> reference count (0: evictable)
        self.live = {}             # seq_id -> (tokens, [chain key or None per block])
        self.done = {}             # seq_id -> its leading full blocks already offered to the cache
        self.stats = dict(queried_tokens=0, reused_tokens=0, evictions=0)

    @property
    def num_free_blocks(self):
        return self.fresh + len(self.evictable)

    def keys(self, tokens):
        bs = self.block_size
        return [tuple(tokens[:(k + 1) * bs]) for k in range(len(tokens) // bs)]

    def _take(self, n):
        for _ in range(n):
            if self.fresh:
                self.fresh -= 1
            else:
                key = next(iter(self.evictable))
                del self.evictable[key], self.cached[key]
                self.stats["evictions"] += 1

    def apply(self, op):
        """The result op must give (("ValueError",) for a refusal), and the new state."""
        kind, args = op[0], op[1:]
        return getattr(self, "_" + kind)(*args)

    def _allocate(self, seq, tokens):
        n, bs = len(tokens), self.block_size
        if seq in self.live or n > self.num_blocks * bs:
            return ("ValueError",)
        keys = self.keys(tokens)
        hits = 0
        while hits < (n - 1) // bs and keys[hits] in self.cached:
            hits += 1
        need = -(-n // bs) - hits
        if need > self.num_free_blocks - sum(self.cached[k] == 0 for k in keys[:hits]):
            return ("ValueError",)
        for k in keys[:hits]:
            if self.cached[k] == 0:
                del self.evictable[k]
            self.cached[k] += 1
        self._take(need)
        self.live[seq] = (list(tokens), keys[:hits] + [None] * need)
        self.done[seq] = hits
        self.stats["queried_tokens"] += n
        self.stats["reused_tokens"] += hits * bs
        self._register(seq)
        return hits * bs

    def _register(self, seq):
        """Offer the sequence's new full blocks to the cache: each enters it unless another
        block already holds its key (and is not offered again later)."""
        tokens, owned = self.live[seq]
        keys = self.keys(tokens)
        for k in range(self.done[seq], len(keys)):
            if keys[k] not in self.cached:
                self.cached[keys[k]] = 1
                owned[k] = keys[k]
        self.done[seq] = len(keys)

    def _append(self, seq, new):
        tokens, owned = self.live[seq]
        total, bs = len(tokens) + len(new), self.block_size
        need = -(-total // bs) - len(owned)
        if total > self.num_blocks * bs or need > self.num_free_blocks:
            return ("ValueError",)
        self._take(need)
        tokens += list(new)
        owned += [None] * need
        self._register(seq)
        return None

    def _free(self, seq):
        _, owned = self.live.pop(seq)
        del self.done[seq]
        for key in reversed(owned):  # the last block first
            if key is None:
                self.fresh += 1
            else:
                self.cached[key] -= 1
                if self.cached[key] == 0:
                    self.evictable[key] = None
        return None

    def _num_free_blocks(self):
        return self.num_free_blocks

    def _stats(self):
        return dict(self.stats)

    def _block_table(self, seqs):
        return "table"  # checked for its invariants, not its numbers

    def _slot_mapping(self, seq, positions):
        return "slots"


def cascade_rule(table, starts, lens, block_size):
    """L6's cascade_prefix_len on lists: the leading block-table columns equal in every row,
    times block_size, capped by the fewest tokens any sequence had cached before the step,
    rounded down to a whole block; 0 for fewer than two sequences."""
    if len(lens) < 2:
        return 0
    shared = 0
    while all(shared < len(row) and row[shared] == table[0][shared] and row[shared] >= 0 for row in table):
        shared += 1
    cached = min(l - (b - a) for l, a, b in zip(lens, starts, starts[1:]))
    return min(shared * block_size, cached) // block_size * block_size


def fingerprint_inputs():
    """(parent, tokens) pairs whose parents differ by MERSENNE: a hash that reduces ints modulo
    2**61 - 1, as Python's hash() does, gives each pair the same value."""
    return [((p, [3, 1, 4, 1]), (p + MERSENNE, [3, 1, 4, 1])) for p in (7, 12345, 2**40 + 11, 2**62)]
