"""Drill E1's cases: the tiny models (configs with seeded random weights, fp32, on the device the kernels run on),
the worked example (content/e1.md §3), EngineCase and its builder, the instrumented
kernels (Recorder, AttentionSpy: picklable, they log into shared tensors from the
learner's worker), the block-manager strategy and the fixture checks."""
import os
from dataclasses import dataclass, field

import _env
import torch
from hypothesis import strategies as st

from _tree import ROOT, load_drill, tree_path

from .reference import reference_tokens, simulate

# Under the interpreter every L1/L3 program runs in Python: tiny models, short prompts.
TEST_SHAPES = dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, block_sizes=(4, 16), max_prompt=40)

# content/e1.md §3: three requests, a budget of 8 tokens, blocks of 4, five steps.
WORKED_EXAMPLE = dict(prompt_lens=[5, 3, 7], max_new=[4, 2, 3], block_size=4, budget=8)


def tiny_model(kind="llama", *, seed=0, layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, head_dim=None, eos=None):
    """A Llama (or Qwen2: q/k/v biases) of the given shape with seeded random weights,
    scaled so that logits spread over O(1) (the default init, std 0.02, leaves them all
    near 0 and every token a near tie). `eos`: the EOS token id (None: none)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  bos_token_id=None, eos_token_id=eos, pad_token_id=None, tie_word_embeddings=False)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=head_dim or hidden // heads))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 1:  # Qwen2's q/k/v biases: large enough to matter
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise * (1.0 if "embed" in name else p.shape[1] ** -0.5))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos if eos is not None else 0
    return model.to(_env.DEVICE).eval()  # where the kernels run: the CPU under the interpreter, else the GPU


def random_prompts(lengths, vocab=64, seed=0, avoid=()):
    """Prompts of these lengths, seeded, without the tokens in `avoid` (an EOS)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab) if t not in set(avoid)])
    return [allowed[torch.randint(len(allowed), (n,), generator=gen)].tolist() for n in lengths]


def kernels_tree(tree):
    """Which tree's L1 and L3 the engine runs on: the graded tree's own, unless
    DRILLS_KERNELS (make grade DRILL=e1 KERNELS=solutions) names another."""
    return str(tree_path(os.environ["DRILLS_KERNELS"])) if os.environ.get("DRILLS_KERNELS") else str(tree)


# ---------------------------------------------------------------------------
# The instrumented kernels


class Recorder:
    """`kernels=` for generate: L1's reshape_and_cache and L3's paged_prefill_attention of
    the trees named, each call logged first into tensors of shared memory, so what the
    learner's worker writes lands here (a Python list would stay in the worker). Log
    records: [1, T, H, D, slots...] with the keys in `floats`; [3, B, W, query_start_loc...,
    seq_lens..., block_table...]."""

    def __init__(self, l1_tree, l3_tree=None, ints=400_000, floats=1_000_000):
        self.l1_tree, self.l3_tree = str(l1_tree), str(l3_tree or l1_tree)
        self.ints = torch.zeros(ints, dtype=torch.int64)
        self.floats = torch.zeros(floats, dtype=torch.float32)
        self.head = torch.zeros(3, dtype=torch.int64)  # ints used, floats used, overflowed

    def _log(self, ints, floats=None):
        i, f = int(self.head[0]), int(self.head[1])
        nf = 0 if floats is None else floats.numel()
        if self.head[2] or i + len(ints) > len(self.ints) or f + nf > len(self.floats):
            self.head[2] = 1
            return
        self.ints[i:i + len(ints)] = torch.tensor(ints, dtype=torch.int64)
        if nf:
            self.floats[f:f + nf] = floats.detach().reshape(-1).float().cpu()
        self.head[0], self.head[1] = i + len(ints), f + nf

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping):
        self._log([1, *key.shape, *slot_mapping.tolist()], key)
        return load_drill(self.l1_tree, "l1_paged_kv_write").reshape_and_cache(key, value, k_cache, v_cache,
                                                                                 slot_mapping)

    def paged_prefill_attention(self, query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=None,
                                out=None):
        self._log([3, *block_table.shape, *query_start_loc.tolist(), *seq_lens.tolist(), *block_table.flatten().tolist()])
        return load_drill(self.l3_tree, "l3_paged_prefill").paged_prefill_attention(
            query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=scale, out=out)

    def calls(self):
        """The logged calls, in order: ("L1", slots, keys [T, H, D]) and ("L3",
        query_start_loc, seq_lens, block_table)."""
        ints, floats = self.ints[:int(self.head[0])].tolist(), self.floats[:int(self.head[1])]
        out, i, f = [], 0, 0
        while i < len(ints):
            if ints[i] == 1:
                t, h, d = ints[i + 1:i + 4]
                out.append(("L1", ints[i + 4:i + 4 + t], floats[f:f + t * h * d].view(t, h, d)))
                i, f = i + 4 + t, f + t * h * d
            else:
                b, w = ints[i + 1:i + 3]
                j = i + 3
                starts, lens = ints[j:j + b + 1], ints[j + b + 1:j + 2 * b + 1]
                table = [ints[j + 2 * b + 1 + r * w:j + 2 * b + 1 + (r + 1) * w] for r in range(b)]
                out.append(("L3", starts, lens, table))
                i = j + 2 * b + 1 + b * w
        return out


class AttentionSpy:
    """A forward pre-hook that counts calls of a module of the model (its own attention,
    its decoder layers, its forward) into a shared tensor."""

    def __init__(self, counts, index):
        self.counts, self.index = counts, index

    def __call__(self, module, args):
        self.counts[self.index] += 1


def spy_on(model):
    """Hook the model's forward, its decoder layers and their attention; returns (counts,
    names): counts[i] is how often names[i] ran."""
    named = [("the model's forward", model), ("the model's base forward (model.model)", model.model)]
    for i, layer in enumerate(model.model.layers):
        named += [(f"decoder layer {i}", layer), (f"model.model.layers[{i}].self_attn", layer.self_attn)]
    counts = torch.zeros(len(named), dtype=torch.int64)
    for i, (_, module) in enumerate(named):
        module.register_forward_pre_hook(AttentionSpy(counts, i))
    return counts, [name for name, _ in named]


# ---------------------------------------------------------------------------
# The case


@dataclass
class EngineCase:
    """One generate() call and what is needed to check and explain it."""
    model: object
    prompts: list
    max_new: list
    block_size: int = 16
    num_blocks: int = None
    budget: int = 256
    what: str = ""
    _reference: list = field(default=None, repr=False)

    def kwargs(self):
        return dict(block_size=self.block_size, num_blocks=self.num_blocks, max_num_batched_tokens=self.budget)

    def reference(self):
        if self._reference is None:
            self._reference = [reference_tokens(self.model, p, n) for p, n in zip(self.prompts, self.max_new)]
        return self._reference

    def schedule(self, new_lens=None):
        """The page's schedule for this case (reference.simulate), given how many tokens
        each request makes (default: the reference's)."""
        new_lens = new_lens or [len(t) for t in self.reference()]
        return simulate([len(p) for p in self.prompts], new_lens, self.block_size, self.num_blocks, self.budget)

    def describe(self):
        config = self.model.config
        return (f"case: {type(self.model).__name__}, {config.num_hidden_layers} layers, H_q={config.num_attention_heads}, "
                f"H_kv={config.num_key_value_heads}, prompts of {[len(p) for p in self.prompts]} tokens, "
                f"max_new_tokens={self.max_new}, block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"max_num_batched_tokens={self.budget}" + (f" ({self.what})" if self.what else ""))


def engine_case(prompt_lens, max_new, *, kind="llama", seed=0, eos=None, model=None, **kwargs):
    model = model or tiny_model(kind, seed=seed, eos=eos)
    prompts = random_prompts(prompt_lens, model.config.vocab_size, seed, avoid={eos})
    max_new = [max_new] * len(prompts) if isinstance(max_new, int) else list(max_new)
    return EngineCase(model, prompts, max_new, **kwargs)


def example_case():
    ex = WORKED_EXAMPLE
    return engine_case(ex["prompt_lens"], ex["max_new"], block_size=ex["block_size"], budget=ex["budget"], seed=0,
                       what="the worked example, content/e1.md §3")


# ---------------------------------------------------------------------------
# The block manager's strategy


@st.composite
def block_ops(draw):
    """(num_blocks, block_size, ops): random allocate / append / free, block tables and slot
    mappings of live sequences, and now and then a request larger than the whole cache.
    Every other op fits in the free blocks (what happens when it does not is the
    scheduler's business, not the block manager's)."""
    num_blocks, block_size = draw(st.integers(1, 8)), draw(st.sampled_from([1, 2, 4, 16]))
    live, free, ops, next_id = {}, num_blocks, [], 0
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["allocate", "allocate", "append", "append", "free", "huge"]))
        if kind == "huge":
            ops.append(("allocate", f"big{next_id}", num_blocks * block_size + draw(st.integers(1, 5))))
            next_id += 1
        elif kind == "allocate" or not live:
            n = draw(st.integers(1, max(1, free * block_size)))
            if -(-n // block_size) <= free:
                live[next_id], free = n, free - -(-n // block_size)
                ops.append(("allocate", next_id, n))
                next_id += 1
        elif kind == "append":
            seq = draw(st.sampled_from(sorted(live)))
            room = -(-live[seq] // block_size) * block_size - live[seq] + free * block_size
            if room:
                n = draw(st.integers(1, room))
                free -= -(-(live[seq] + n) // block_size) - -(-live[seq] // block_size)
                live[seq] += n
                ops.append(("append", seq, n))
        else:
            seq = draw(st.sampled_from(sorted(live)))
            free += -(-live.pop(seq) // block_size)
            ops.append(("free", seq))
        ops.append(("num_free_blocks",))
        if live:
            ops.append(("block_table", sorted(live)))
            seq = draw(st.sampled_from(sorted(live)))
            ops.append(("slot_mapping", seq, list(range(live[seq]))))
    return num_blocks, block_size, ops


# ---------------------------------------------------------------------------
# The fixture checks


def _check_models_have_clear_margins(device):
    """The worked example's reference tokens are not near ties, and the spread of logits
    is O(1): a mistake moves tokens, a right engine keeps them."""
    from .reference import LOGIT_TOLERANCE, model_logits
    case = example_case()
    for prompt, new in zip(case.prompts, case.reference()):
        top2 = model_logits(case.model, prompt, new).topk(2).values
        assert bool((top2[:, 0] - top2[:, 1] > 100 * LOGIT_TOLERANCE).all()), "a near tie in the worked example"


def _check_recorder_round_trip(device):
    rec = Recorder(ROOT / "solutions")
    rec._log([1, 2, 1, 3, 7, 9], torch.arange(6.0))
    rec._log([3, 1, 2, 0, 5, 5, 4, -1])
    (k1, slots, keys), (k3, starts, lens, table) = rec.calls()
    assert (k1, slots, keys.shape, k3, starts, lens, table) == ("L1", [7, 9], (2, 1, 3), "L3", [0, 5], [5], [[4, -1]])


FIXTURE_CHECKS = (_check_models_have_clear_margins, _check_recorder_round_trip)
