"""Drill E2's cases: the engine cases (E1's tiny models and EngineCase, prompts that share
prefixes), the instrumented kernels (E1's Recorder plus L6's two functions), the worked
example (content/e2.md §4), the fixed block-manager traces of the pitfalls, and the
hypothesis state machine that draws random allocate / append / free / preempt traces."""
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from _tree import load_drill
from drills.e1.cases import EngineCase, Recorder, random_prompts, tiny_model

from .reference import BlockManagerModel

TEST_SHAPES = dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, block_sizes=(4, 16))
WRITES = {"generate": ("kernels",)}
PRELOAD = ("drills.e2.cases", "drills.e1.cases", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2")

# content/e2.md §4: blocks of 4, a cache of 6 blocks; three prompts that share a system prompt.
SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18]
WORKED_EXAMPLE = dict(num_blocks=6, block_size=4, ops=[
    ("allocate", "A", SYSTEM + [21, 22, 23]),   # 11 tokens: 3 blocks, nothing cached yet
    ("allocate", "B", SYSTEM + [31, 32]),       # 10 tokens: reuses A's two full blocks
    ("free", "A"),
    ("allocate", "C", SYSTEM),                  # 8 tokens: reuses one block, never the whole prompt
    ("num_free_blocks",),
    ("stats",),
])


# ---------------------------------------------------------------------------
# The instrumented kernels


class PrefixRecorder(Recorder):
    """E1's Recorder (L1 and L3 of a tree, every call logged into shared tensors) plus L6:
    cascade_prefix_len passes through, cascade_attention is logged as
    [6, B, W, common_prefix_len, query_start_loc..., seq_lens..., block_table...]. K/V are
    not logged (E2's diagnosis does not need them)."""

    def slot_mapping(self, block_table, seq_idx, positions, block_size):
        return load_drill(self.l1_tree, "l1_paged_kv_write").slot_mapping(block_table, seq_idx, positions, block_size)

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping):
        self._log([1, *key.shape, *slot_mapping.tolist()])
        return load_drill(self.l1_tree, "l1_paged_kv_write").reshape_and_cache(key, value, k_cache, v_cache,
                                                                                 slot_mapping)

    def cascade_prefix_len(self, block_table, query_start_loc, seq_lens, block_size):
        return load_drill(self.l3_tree, "l6_cascade_attention").cascade_prefix_len(block_table, query_start_loc,
                                                                                    seq_lens, block_size)

    def cascade_attention(self, query, k_cache, v_cache, block_table, query_start_loc, seq_lens, common_prefix_len,
                          scale=None, out=None):
        self._log([6, *block_table.shape, int(common_prefix_len), *query_start_loc.tolist(), *seq_lens.tolist(),
                   *block_table.flatten().tolist()])
        return load_drill(self.l3_tree, "l6_cascade_attention").cascade_attention(
            query, k_cache, v_cache, block_table, query_start_loc, seq_lens, common_prefix_len, scale=scale, out=out)

    def calls(self):
        """("L1", slots), ("L3", query_start_loc, seq_lens, block_table, 0) and ("L6", the same
        and common_prefix_len), in order."""
        ints, out, i = self.ints[:int(self.head[0])].tolist(), [], 0
        while i < len(ints):
            if ints[i] == 1:
                t = ints[i + 1]
                out.append(("L1", ints[i + 4:i + 4 + t]))
                i += 4 + t
                continue
            kind, b, w = ints[i:i + 3]
            prefix = ints[i + 3] if kind == 6 else 0
            j = i + (4 if kind == 6 else 3)
            starts, lens = ints[j:j + b + 1], ints[j + b + 1:j + 2 * b + 1]
            table = [ints[j + 2 * b + 1 + r * w:j + 2 * b + 1 + (r + 1) * w] for r in range(b)]
            out.append(("L6" if kind == 6 else "L3", starts, lens, table, prefix))
            i = j + 2 * b + 1 + b * w
        return out


# ---------------------------------------------------------------------------
# The engine cases


@dataclass
class PrefixCase(EngineCase):
    """E1's EngineCase with prefix caching on or off."""
    caching: bool = True

    def kwargs(self):
        return dict(super().kwargs(), enable_prefix_caching=self.caching)

    def describe(self):
        return super().describe() + f", enable_prefix_caching={self.caching}"


def prefix_case(system_len, tails, max_new, *, seed=0, model=None, exact=(), **kwargs):
    """Prompts that start with one shared system prompt of `system_len` tokens, each followed
    by its own tail (a length; 0 for the system prompt alone); `exact`: (i, j) pairs, prompt
    i made a copy of prompt j."""
    model = model or tiny_model(seed=seed)
    system = random_prompts([system_len], model.config.vocab_size, seed + 100)[0]
    prompts = [system + t for t in random_prompts(tails, model.config.vocab_size, seed)]
    for i, j in exact:
        prompts[i] = list(prompts[j])
    max_new = [max_new] * len(prompts) if isinstance(max_new, int) else list(max_new)
    return PrefixCase(model, prompts, max_new, **kwargs)


# ---------------------------------------------------------------------------
# Fixed block-manager traces (blocks of 4 unless said), one per pitfall that shows there

def _t(*blocks):
    return [x for b in blocks for x in (b if isinstance(b, list) else [b])]


P, Q, R, S = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [9, 8, 7, 6]
TRACES = {
    # Two identical 64-token prompts, blocks of 16: the second reuses 48 (content/e2.md §1).
    "identical_prompts": (8, 16, [("allocate", 0, list(range(100, 164))), ("allocate", 1, list(range(100, 164))),
                                  ("num_free_blocks",), ("stats",)]),
    # A prompt of exactly two blocks, cached: reused 4, never 8.
    "whole_prompt": (4, 4, [("allocate", 0, _t(P, Q)), ("allocate", 1, _t(P, Q)), ("stats",),
                            ("block_table", [0, 1])]),
    # A partly filled block fills later: its full hash must be what a later prompt finds.
    "partial_then_full": (6, 4, [("allocate", 0, _t(P, 5, 6)), ("append", 0, [7, 8]), ("append", 0, [1]),
                                 ("allocate", 1, _t(P, Q, 2)), ("stats",), ("free", 0), ("free", 1),
                                 ("num_free_blocks",), ("allocate", 2, _t(P, Q, R, 3)), ("stats",)]),
    # The same block of tokens after different prefixes, and at another position.
    "same_tokens_elsewhere": (8, 4, [("allocate", 0, _t(P, Q, 1)), ("allocate", 1, _t(Q, P, 2)),
                                     ("allocate", 2, _t(R, Q, 3)), ("stats",)]),
    # A hit on an evictable block: it leaves the free queue while in use.
    "hit_on_evictable": (3, 4, [("allocate", 0, _t(P, 1)), ("free", 0), ("num_free_blocks",),
                                ("allocate", 1, _t(P, 2)), ("num_free_blocks",), ("allocate", 2, [3]),
                                ("num_free_blocks",), ("block_table", [1, 2]), ("stats",)]),
    # An evicted block refilled with a partial block: its old hash must be gone.
    "evicted_then_partial": (3, 4, [("allocate", 0, _t(P, 1)), ("free", 0), ("allocate", 1, _t(R, R, 9)),
                                    ("free", 1), ("num_free_blocks",), ("allocate", 2, _t(Q, 5)),
                                    ("allocate", 3, _t(P, 1)), ("stats",)]),
    # An evicted block refilled and cached under another hash: the map's old entry must miss.
    "evicted_then_recached": (3, 4, [("allocate", 0, _t(P, 1)), ("free", 0), ("allocate", 1, _t(Q, R, S)),
                                     ("free", 1), ("allocate", 2, _t(P, 3)), ("stats",)]),
    # Eviction order: never-cached free blocks first, then the least recently freed.
    "eviction_order": (5, 4, [("allocate", 0, _t(P, 1)), ("allocate", 1, _t(Q, 2)), ("free", 1), ("free", 0),
                              ("allocate", 2, _t(R, R, S, 3)), ("stats",), ("free", 2), ("allocate", 3, _t(P, 4)),
                              ("allocate", 4, _t(Q, 5)), ("stats",)]),
}


# ---------------------------------------------------------------------------
# The random traces: a hypothesis state machine

# Token families that share prefixes, repeat blocks at other positions and differ late.
FAMILIES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0],
            [5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random allocate / append / free / preempt (a free of a running request, recomputed
    later with its tokens so far) on a small cache, mirrored by BlockManagerModel; at the
    end the whole trace is replayed in the learner's worker (`replay`, set by the test)
    and checked op by op (`check`, set by the test)."""
    replay = check = None

    def __init__(self):
        super().__init__()
        self.ops, self.model, self.next_id, self.parked = [], None, 0, []

    @initialize(num_blocks=st.integers(2, 8), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.model = BlockManagerModel(num_blocks, block_size)

    def _do(self, op):
        self.ops.append(op)
        result = self.model.apply(op)
        self.ops.append(("num_free_blocks",))
        return result

    @rule(family=st.sampled_from(FAMILIES), length=st.integers(1, 12), tail=st.lists(st.integers(0, 3), max_size=4))
    def allocate(self, family, length, tail):
        self._do(("allocate", self.next_id, family[:length] + tail))
        self.next_id += 1

    @precondition(lambda self: self.model is not None and self.model.live)
    @rule(data=st.data())
    def append(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model.live)))
        self._do(("append", seq, data.draw(st.lists(st.integers(0, 12), min_size=1, max_size=5))))

    @precondition(lambda self: self.model is not None and self.model.live)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        seq = data.draw(st.sampled_from(sorted(self.model.live)))
        tokens = list(self.model.live[seq][0])
        self._do(("free", seq))
        if preempt:  # recomputed later: allocated again with every token it had
            self.parked.append(tokens)

    @precondition(lambda self: self.parked)
    @rule()
    def resume(self):
        self._do(("allocate", self.next_id, self.parked.pop(0)))
        self.next_id += 1

    @precondition(lambda self: self.model is not None)
    @rule(extra=st.integers(1, 3))
    def too_large(self, extra):
        self._do(("allocate", f"big{self.next_id}", [0] * (self.num_blocks * self.block_size + extra)))
        self.next_id += 1

    @precondition(lambda self: self.model is not None)
    @rule()
    def look(self):
        self.ops.append(("stats",))
        if self.model.live:
            seqs = sorted(self.model.live)
            self.ops.append(("block_table", seqs))
            self.ops.append(("slot_mapping", seqs[0], list(range(len(self.model.live[seqs[0]][0])))))

    def teardown(self):
        if self.model is not None and self.ops:
            self.check(self.num_blocks, self.block_size, self.ops, self.replay(self.num_blocks, self.block_size, self.ops))
