"""E1's bench (issue 23; a GPU run, recorded in BENCHMARKS.md, not a timed test): a
Llama-shaped model of about 1 B parameters with random bf16 weights, 64 requests of
512-token prompts and 128 new tokens each; the engine against transformers' own
batched generate. `bytes` is one decode step's floor: the weights plus the KV read.
`python -m drills.e1.bench smollm2-shape` times the same engine on SmolLM2-135M's shape
(random weights), 64 requests of 128-token prompts and 128 new tokens each.

And `make chat` (`chat` below): the learner's engine serving the real model,
SmolLM2-135M-Instruct, on any machine, its replies checked against generate."""
import argparse
import sys
import time
from pathlib import Path

import _env
import torch

from _drill import BenchCase
from _chat import NotingKernels, Ticker, describe, reuse_line, shown, template, text_of, token_lists, watching
from _render import clean_text
from _tree import load_drill, parameters, tree_path
from _worker import TIMEOUT, LearnerCrash, LearnerTimeout, reset_all, tree_module

from .cases import (NAME, PRELOAD, WRITES, cached_smollm2, install_hint, kernels_tree, load_folder, load_smollm2,
                    smollm2_available, tiny_model)
from .mistakes import PLANTED
from .reference import LOGIT_TOLERANCE, eos_ids, model_logits, reference_tokens

STEM = PLANTED.stem

MODEL = dict(hidden=2048, layers=16, heads=32, kv_heads=8, vocab=32000, intermediate=8192)
# SmolLM2-135M's shape (its real weights are too large to carry to the GPU machine; random
# ones serve for timing), at issue 38's workload: there the host's share of a step is larger.
SMOLLM2_SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, vocab=49152, intermediate=1536)
SMOLLM2_PARAMS = dict(num_seqs=64, prompt=128, new=128, budget=8192)


def weight_bytes(hidden, layers, heads, kv_heads, vocab, intermediate, size=2):
    head = hidden // heads
    attn = hidden * (heads + 2 * kv_heads) * head + heads * head * hidden
    mlp = 3 * hidden * intermediate
    return size * (layers * (attn + mlp + 2 * hidden) + 2 * vocab * hidden + hidden)


def decode_step_bytes(num_seqs, context, hidden, layers, heads, kv_heads, size=2, **model):
    """The fewest bytes of one decode step: every weight read once, plus each sequence's
    cached K and V (context tokens) read once per layer."""
    kv = 2 * num_seqs * context * kv_heads * (hidden // heads) * size * layers
    return weight_bytes(hidden, layers, heads, kv_heads, size=size, **model) + kv


def decode_step_flops(num_seqs, context, hidden, layers, heads, kv_heads, vocab, intermediate, **_):
    params = weight_bytes(hidden, layers, heads, kv_heads, vocab, intermediate, size=1)
    return 2 * num_seqs * params + 4 * num_seqs * heads * context * (hidden // heads) * layers


def bench_model(device, seed=0, shape=MODEL):
    from transformers import LlamaConfig, LlamaForCausalLM
    m = shape
    config = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                         num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                         num_key_value_heads=m["kv_heads"], max_position_embeddings=4096, eos_token_id=None,
                         bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


_PARAMS = dict(num_seqs=64, prompt=512, new=128, budget=8192)
# A decode step at the mean context (512 + 64 tokens): the weights plus the KV read.
BENCH = (BenchCase("1B llama, 64 x (512 + 128)", _PARAMS,
                   decode_step_bytes(64, 576, **MODEL), decode_step_flops(64, 576, **MODEL)),)


def decode_step_times(module, model, context, num_seqs, device="cuda"):
    """One decode step's forward (num_seqs sequences at `context` cached tokens), eager and
    replayed as a CUDA graph: what graphs would buy the engine. It reads the reference
    engine's own parts (BlockManager, Request, _prepare, _forward); None for a tree
    without them."""
    from triton.testing import do_bench
    if not all(hasattr(module, name) for name in ("BlockManager", "Request", "_prepare", "_forward")):
        return None
    config, block_size = model.config, 16
    head_dim = model.model.layers[0].self_attn.head_dim
    num_blocks = num_seqs * -(-(context + 1) // block_size)
    shape = (num_blocks, block_size, config.num_key_value_heads, head_dim)
    caches = [(torch.randn(shape, dtype=torch.bfloat16, device=device),
               torch.randn(shape, dtype=torch.bfloat16, device=device)) for _ in model.model.layers]
    blocks, batch = module.BlockManager(num_blocks, block_size), []
    for i in range(num_seqs):
        request = module.Request(i, [1] * (context + 1), 1)
        blocks.allocate(i, context + 1)
        request.computed = context
        batch.append((request, 1))
    step = module._prepare(blocks, batch, device)
    kernels = module._tree_kernels()

    def forward():
        return module._forward(model, caches, step, kernels)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) off the capturing stream
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    eager = do_bench(forward, warmup=5, rep=300, return_mode="median")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = forward()
    graph.replay()
    same = bool(torch.equal(logits, forward()))
    replay = do_bench(graph.replay, warmup=5, rep=300, return_mode="median")
    return dict(eager_ms=round(eager, 2), graph_ms=round(replay, 2), graph_logits_equal=same)


def measure(module, device="cuda", params=_PARAMS, start=None, extras=True, shape=MODEL):
    """One timed run each (a whole generate is seconds: no repeats), after a warm-up with
    the same workload (the first run compiles the kernels for every shape it meets): the
    engine's tokens/s as it serves (kernels=None: the reference replays decode steps as
    CUDA graphs) and transformers' batched `generate`, and the engine's decode step,
    (T(new) - T(1)) / (new - 1), against its floor (bytes over the copy ceiling). `start()`,
    called once all is warm and before anything is timed, returns the ceiling (the grade's
    bench, tests/_bench.py: it returns when the tests are done); without it the ceiling is
    measured here. extras: also the engine eager (kernels= handed in: no graphs),
    transformers' continuous batching (`generate_batch`) and one decode step's forward
    eager and as a graph (the grade's row leaves them out: they cost it time, not its row)."""
    from _bench import copy_ceiling_gbps
    model = bench_model(device, shape=shape)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, shape["vocab"], (params["num_seqs"], params["prompt"]), generator=gen)
    tokens = params["num_seqs"] * params["new"]

    def timed(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def engine(new, kernels=None):
        return lambda: module.generate(model, prompts.tolist(), new, block_size=16,
                                       max_num_batched_tokens=params["budget"], kernels=kernels)

    def hf(new):
        def run():
            with torch.no_grad():
                p = prompts.to(device)
                model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
        return run
    own = extras and hasattr(module, "_tree_kernels") and module._tree_kernels()  # the engine's eager path
    # Warm-ups with the whole workload: the first run of each prepares for every shape it meets.
    # transformers' SDPA (cuDNN) compiles a kernel at each new context length, tens of ms a
    # call the first time: warmed with 4 tokens, generate was timed while still compiling
    # (E1 in BENCHMARKS.md).
    timed(hf(params["new"]))
    timed(engine(params["new"]))
    if own:
        timed(engine(4, own))  # its step tensors are int32, the graphs' int64, so Triton compiles again
    ceiling = start() if start else copy_ceiling_gbps()
    theirs = timed(hf(params["new"]))
    full, one = timed(engine(params["new"])), timed(engine(1))
    eager = timed(engine(params["new"], own)) if own else None
    step = (full - one) / (params["new"] - 1)
    mean_context = params["prompt"] + params["new"] // 2
    floor = decode_step_bytes(params["num_seqs"], mean_context, **shape) / (ceiling * 1e9)
    result = dict(engine_tokens_per_s=round(tokens / full), transformers_tokens_per_s=round(tokens / theirs),
                  speedup=round(theirs / full, 2), engine_s=round(full, 2), transformers_s=round(theirs, 2),
                  prefill_s=round(one, 3), decode_step_ms=round(step * 1e3, 2),
                  decode_floor_ms=round(floor * 1e3, 2))
    if eager is not None:
        result.update(eager_tokens_per_s=round(tokens / eager), eager_speedup=round(theirs / eager, 2))
    if extras:
        result.update(continuous_batching(model, prompts, params["new"], timed))
        result["decode_forward"] = decode_step_times(module, model, mean_context, params["num_seqs"], device)
    return result


def bench_rows(module, start):
    """The grade's bench row (the Drill's `bench_run`, tests/_bench.py): the engine's tokens/s
    beside transformers' batched `generate` on BENCH's workload, each timed once after a
    warm-up, and the ratio; what else was measured rides along as `measured`."""
    return rows_of(measure(module, start=start, extras=False))


def rows_of(measured, params=_PARAMS):
    """bench_rows' shaping of `measure`'s result (apart, so the CPU can check the row a GPU prints)."""
    tokens = params["num_seqs"] * params["new"]

    def row(tokens_per_s):
        return dict(us=round(tokens / tokens_per_s * 1e6, 1), rate=tokens_per_s)
    case = BENCH[0]
    return [dict(name=case.name, params=case.params, bytes=case.bytes, flops=case.flops, unit="tokens/s", tier="",
                 ours=row(measured["engine_tokens_per_s"]),
                 baselines={"transformers generate": row(measured["transformers_tokens_per_s"])},
                 measured=measured)]


def continuous_batching(model, prompts, new, timed):
    """transformers' own continuous batching (`generate_batch`, paged attention), the
    call a transformers user would pick over `generate` to serve many requests: its
    tokens/s on the same prompts, after a warm-up run; an `error` when this version of
    transformers has none or it fails."""
    from transformers import GenerationConfig
    if not hasattr(model, "generate_batch"):
        return dict(continuous_batching_error="this transformers has no generate_batch")
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    made = []

    def run():
        with torch.no_grad():
            out = model.generate_batch(prompts.tolist(), generation_config=config, progress_bar=False)
        made.append(sum(len(o.generated_tokens) for o in out.values()))
    try:
        timed(run)  # warm: compiles, captures its graphs
        seconds = timed(run)
    except Exception as error:  # a baseline that does not run is reported, not fatal
        return dict(continuous_batching_error=f"{type(error).__name__}: {str(error)[:200]}")
    return dict(continuous_batching_tokens_per_s=round(made[-1] / seconds), continuous_batching_s=round(seconds, 2),
                continuous_batching_tokens=made[-1])


# ---------------------------------------------------------------------------
# `make chat` (= grader.py chat; PROMPT=, TOKENS=, TREE=, KERNELS=, MODEL=, TIMEOUT=, TURNS=,
# PROMPTS_FILE=): the engine serving SmolLM2-135M-Instruct, against transformers' generate.
# The prompts (`|` separates several) go under the model's chat template, served in one
# generate() call, batched, greedy, in a worker as in the grade; the kernels handed to it
# note each step, printed as a line (tests/_chat.py). Then each reply's text and its check
# against transformers' generate: equal, or where it first differs, with both logits.
# TURNS=n (or PROMPTS_FILE=, a message a line) is a chat: turn k repeats the earlier turns
# and their replies, on the tree's E2 engine, which says what it reused (E1's while E2 is
# not written, saying so). Exits 0 when the chat ran (whatever the check found) or the engine
# is not written yet; 1 when the model did not load or the learner's code failed; 2: usage.

DEFAULT_PROMPT = "What is 2+2?"
DEFAULT_TOKENS = 16  # SmolLM2 answers the default prompt in 12 tokens and stops at EOS
DEFAULT_TURNS = ("What is 2+2?", "And 3+3?", "Add the two answers.", "Say it in words.")
E2 = "e2_prefix_cache"
KERNEL_STEMS = {"slot_mapping": "l1_paged_kv_write", "reshape_and_cache": "l1_paged_kv_write",
                "paged_prefill_attention": "l3_paged_prefill", "cascade_prefix_len": "l6_cascade_attention",
                "cascade_attention": "l6_cascade_attention"}  # E1 calls two, E2 all five


def chat_kernels(tree, layers):
    return NotingKernels(tree, KERNEL_STEMS, ("paged_prefill_attention", "cascade_attention"), layers)


def chat(argv=None):
    parser = argparse.ArgumentParser(prog="make chat", description="your E1 engine serving a real model, checked "
                                     "against transformers' generate")
    parser.add_argument("--prompt", default="", help="one prompt, or several separated by |")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="new tokens per reply at most")
    parser.add_argument("--tree", default="mine", help="whose engine: mine, solutions or a folder")
    parser.add_argument("--model", default="", help="a checkpoint folder of a Llama or Qwen2 (default: SmolLM2)")
    parser.add_argument("--timeout", type=float, default=0, help="seconds your engine may take (10 x TIMEOUT)")
    parser.add_argument("--turns", type=int, default=0, help="a chat of this many turns, on your E2 engine")
    parser.add_argument("--prompts-file", default="", help="a chat whose turns are this file's lines")
    args = parser.parse_args(argv)
    prompts = [p.strip() for p in (args.prompt or DEFAULT_PROMPT).split("|") if p.strip()]
    try:
        tree, turns = tree_path(args.tree), chat_turns(args, prompts)
        kernels = kernels_tree(tree)
    except (OSError, ValueError) as error:
        print(f"chat: {error}", file=sys.stderr)
        return 2
    with torch.no_grad():
        return _chat(args, tree, kernels, prompts, turns)


def chat_turns(args, prompts):
    """The user messages of a chat (TURNS= or PROMPTS_FILE=), or None for one batched call."""
    if args.tokens < 1:
        raise ValueError("TOKENS must be >= 1")
    if not (args.turns or args.prompts_file):
        return None
    given = open(args.prompts_file, encoding="utf-8").read().splitlines() if args.prompts_file else \
        (prompts if args.prompt else DEFAULT_TURNS)
    turns = [t.strip() for t in given if t.strip()]
    if not 0 < (args.turns or len(turns)) <= len(turns):
        raise ValueError(f"TURNS={args.turns}, but there are {len(turns)} messages to send (PROMPT=\"a|b|c\" or "
                         f"PROMPTS_FILE= gives more)")
    return turns[:args.turns or len(turns)]


def _chat(args, tree, kernels, prompts, turns):
    contract = {fn: (names, WRITES.get(fn, ())) for fn, names in parameters(STEM).items()}  # as the grade's
    engine = tree_module(tree, STEM, contract=contract, readable=[kernels], preload=PRELOAD)
    budget = args.timeout or 10 * TIMEOUT  # one generate() of a real model is no test's worth of work
    print(f"starting a worker for {shown(tree)}/ and trying its engine on a tiny random model ...", flush=True)
    try:  # a stub says so at once, before the model takes its seconds to load
        reset_all(budget=budget)
        engine.generate(tiny_model(), [[1, 2, 3]], 1, kernels=chat_kernels(kernels, 2))
    except NotImplementedError as error:
        return not_written(error, tree, kernels)
    except (LearnerCrash, LearnerTimeout, Exception) as error:  # the learner's code: say what, and where
        return failed(error, "on a tiny random model (the tests' kind; make grade DRILL=e1 explains more)")
    e2 = e2_engine(tree, kernels, budget) if turns else None
    loaded = load(args.model)
    if loaded is None:
        return 1
    model, tokenizer = loaded
    print(f"engine: {shown(tree)}/{E2 if e2 else STEM}.py on the kernels of {shown(kernels)}/, {_env.describe()}")
    if turns:
        return chat_of_turns(e2 or engine, bool(e2), model, tokenizer, turns, args, kernels, budget)
    ids = [template(tokenizer, [p]) for p in prompts]
    print(f"serving {len(ids)} prompt(s) of {[len(p) for p in ids]} tokens, up to {args.tokens} new tokens each; a "
          f"line per step of your engine:", flush=True)
    served = serve(engine, model, ids, args.tokens, kernels, budget)
    if isinstance(served, int):
        return served
    replies, seconds, _ = served
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        print(f"\n[{i + 1}] {prompt}\n{text_of(tokenizer, reply)}")
    made = sum(map(len, replies))
    print(f"\n{made} new tokens in {seconds:.1f} s: {made / seconds:.2f} tokens/s over the one generate() call, "
          f"prompts batched")
    for i, (prompt, reply) in enumerate(zip(ids, replies)):
        print(f"[{i + 1}] " + compare(model, tokenizer, prompt, reply, args.tokens))
    return 0


def e2_engine(tree, kernels, budget):
    """The tree's E2 engine when it serves (tried on a tiny model), else None, saying why."""
    if not (Path(tree) / f"{E2}.py").is_file():
        print(f"{shown(tree)}/ has no {E2}.py: the chat runs on E1's engine, which reuses nothing between turns")
        return None
    contract = {"generate": (parameters(E2)["generate"], ("kernels",))}  # the model's weights only read
    engine = tree_module(tree, E2, contract=contract, readable=[kernels], preload=PRELOAD)
    try:
        reset_all(budget=budget)
        engine.generate(tiny_model(), [[1, 2, 3]], 1, kernels=chat_kernels(kernels, 2), return_stats=True)
    except NotImplementedError:
        print(f"E2 not written yet ({shown(tree)}/{E2}.py): the chat runs on E1's engine, which reuses nothing")
        return None
    except (LearnerCrash, LearnerTimeout, Exception) as error:
        failed(error, "on a tiny random model (make grade DRILL=e2 explains more); the chat runs on E1's engine")
        return None
    return engine


def chat_of_turns(engine, is_e2, model, tokenizer, turns, args, kernels, budget):
    """Turn k: the earlier turns, their replies and message k. E2's cache lives within a call, so
    turn k's serves turn k - 1's prompt first (1 token, steps of its length), then reuses it."""
    history, previous = [], None
    for k, message in enumerate(turns, start=1):
        history.append(message)
        ids = template(tokenizer, history)
        batch = [previous, ids] if is_e2 and previous else [ids]
        print(f"\n[turn {k}] {message}  ({len(ids)} prompt tokens" + (f", served after the previous turn's "
              f"{len(previous)}" if len(batch) == 2 else "") + "; a line per step)", flush=True)
        served = serve(engine, model, batch, [1] * (len(batch) - 1) + [args.tokens], kernels, budget, stats=is_e2,
                       **(dict(max_num_batched_tokens=len(previous)) if len(batch) == 2 else {}))
        if isinstance(served, int):
            return served
        replies, seconds, stats = served
        history.append(text_of(tokenizer, replies[-1]))
        print(f"{history[-1]}\n{len(replies[-1])} new tokens in {seconds:.1f} s; "
              + (reuse_line(stats, len(ids)) if is_e2 else "E1 reuses nothing: every prompt token computed"))
        print(compare(model, tokenizer, ids, replies[-1], args.tokens))
        previous = ids
    return 0


def serve(engine, model, ids, tokens, kernels, budget, stats=False, **options):
    """engine.generate on `ids` (`tokens` new ones at most, or one count per prompt), a line per
    step while it runs: (replies, seconds, stats or None), or the exit status when it failed."""
    started = time.monotonic()
    try:
        reset_all(budget=budget)
        with watching(max(tokens) if isinstance(tokens, list) else tokens):
            result = engine.generate(model, ids, tokens, kernels=chat_kernels(kernels, model.config.num_hidden_layers),
                                     **options, **(dict(return_stats=True) if stats else {}))
    except NotImplementedError as error:
        return not_written(error, Path(kernels), kernels)
    except (LearnerCrash, LearnerTimeout, Exception) as error:
        return failed(error, f"serving {NAME}")
    replies, extra = result if stats and isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not token_lists(replies, len(ids)):
        print(f"your engine returned {clean_text(str(result)[:200])}, not one list of token ids per prompt "
              f"(content/e1.md §1)")
        return 1
    return replies, time.monotonic() - started, extra


def load(folder):
    """(model, tokenizer) on the kernels' device, or None, said in one line. No time is promised
    (the kept copy took 2-8 s here, the GGUF file 20-74 s): a line every 10 s says it goes on."""
    first = not folder and not cached_smollm2()
    print(f"loading {folder or NAME}" + (" from its GGUF file, this once (later calls read a copy kept in "
                                         ".drills/models)" if first else "") + " ...", flush=True)
    try:
        with Ticker("  still loading") as ticks:
            model, tokenizer = load_folder(folder) if folder else load_smollm2()
    except (OSError, ValueError) as error:
        hint = "" if folder or smollm2_available() else f"\n  {install_hint()}"
        print(f"chat: the model could not be loaded: {error}{hint}", file=sys.stderr)
        return None
    print(f"{describe(model, folder or NAME)}; loaded in {ticks.seconds:.1f} s")
    return model, tokenizer


def failed(error, doing):
    where = getattr(error, "where", None)
    said = f"your engine failed {doing}: {type(error).__name__}: {error}" + (f"\n  at {where}" if where else "")
    print(clean_text(said))  # the learner's exception and where it rose are its text: no escape reaches the terminal
    return 1


def compare(model, tokenizer, prompt, reply, max_new):
    """The reply against transformers' generate: equal, or where it first differs and how
    far apart the model puts the two tokens there."""
    want = reference_tokens(model, prompt, max_new)
    if reply == want:
        end = " and EOS" if want and want[-1] in eos_ids(model) else ""
        return f"equal to transformers' generate, token for token ({len(want)} token{'s' * (len(want) != 1)}{end})"
    j = next((j for j, (a, b) in enumerate(zip(reply, want)) if a != b), min(len(reply), len(want)))
    if j == len(reply) or j == len(want):
        longer, n = ("generate", len(want)) if j == len(reply) else ("your engine", len(reply))
        return (f"differs from transformers' generate after {j} equal tokens: {longer} goes on to {n} "
                f"(yours {reply}, generate's {want})")
    logits = model_logits(model, prompt, reply[:j + 1])[j]  # the step both saw the same tokens before
    ours, theirs = float(logits[reply[j]]), float(logits[want[j]])
    verdict = ("a near tie: both are the model's top choice within the grade's tolerance"
               if abs(ours - theirs) <= LOGIT_TOLERANCE else "your token is not the model's greedy choice")
    return (f"first differs from transformers' generate at new token {j}: yours {tokenizer.decode([reply[j]])!r} "
            f"(id {reply[j]}, logit {ours:.4f}), generate's {tokenizer.decode([want[j]])!r} (id {want[j]}, logit "
            f"{theirs:.4f}): {verdict}")


def not_written(error, tree, kernels):
    """A stub: nothing to chat with yet, which is no failure of the command."""
    for drill_id in ("l1", "l3"):
        if f"content/{drill_id}.md" in str(error):
            name = drill_id.upper()
            print(f"{name} not written yet ({shown(kernels)}/): the engine runs on it. Pass {name} first, or chat on "
                  f"the reference kernels: make chat KERNELS=solutions")
            return 0
    print(f"E1 not written yet: {shown(tree)}/{STEM}.py raises NotImplementedError ({clean_text(str(error))}). "
          f"Read content/e1.md; meanwhile `make chat TREE=solutions` shows the reference engine")
    return 0


if __name__ == "__main__":  # the benches by hand; `make chat` is grader.py chat
    import json
    shape, params = (SMOLLM2_SHAPE, SMOLLM2_PARAMS) if sys.argv[1:2] == ["smollm2-shape"] else (MODEL, _PARAMS)
    print(json.dumps(measure(load_drill("solutions", "e1_paged_engine"), params=params, shape=shape)))
