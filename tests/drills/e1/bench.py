"""E1's bench (issue 23; a GPU run, recorded in BENCHMARKS.md, not a timed test): a
Llama-shaped model of about 1 B parameters with random bf16 weights, 64 requests of
512-token prompts and 128 new tokens each; the engine against transformers' own
batched generate. `bytes` is one decode step's floor: the weights plus the KV read."""
import torch

from _drill import BenchCase

MODEL = dict(hidden=2048, layers=16, heads=32, kv_heads=8, vocab=32000, intermediate=8192)


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


def bench_model(device, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    m = MODEL
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


def measure(module, device="cuda", params=_PARAMS):
    """One timed run each (a whole generate is seconds: no repeats), after a warm-up with
    the same workload (the first run compiles the kernels for every shape it meets): the
    engine's and transformers' tokens/s, and the engine's decode step,
    (T(new) - T(1)) / (new - 1), against its floor (bytes over the ceiling)."""
    import time

    from _bench import copy_ceiling_gbps
    model = bench_model(device)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, MODEL["vocab"], (params["num_seqs"], params["prompt"]), generator=gen)

    def timed(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def engine(new):
        return lambda: module.generate(model, prompts.tolist(), new, block_size=16,
                                       max_num_batched_tokens=params["budget"])

    def hf(new):
        def run():
            with torch.no_grad():
                p = prompts.to(device)
                model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
        return run
    timed(engine(params["new"])), timed(hf(4))  # compile and warm
    full, one = timed(engine(params["new"])), timed(engine(1))
    theirs = timed(hf(params["new"]))
    tokens = params["num_seqs"] * params["new"]
    step = (full - one) / (params["new"] - 1)
    floor = BENCH[0].bytes / (copy_ceiling_gbps() * 1e9)
    mean_context = params["prompt"] + params["new"] // 2
    return dict(engine_tokens_per_s=round(tokens / full), transformers_tokens_per_s=round(tokens / theirs),
                speedup=round(theirs / full, 2), engine_s=round(full, 2), transformers_s=round(theirs, 2),
                prefill_s=round(one, 3), decode_step_ms=round(step * 1e3, 2), decode_floor_ms=round(floor * 1e3, 2),
                decode_forward=decode_step_times(module, model, mean_context, params["num_seqs"], device))


if __name__ == "__main__":
    import json

    from _tree import load_drill
    print(json.dumps(measure(load_drill("solutions", "e1_paged_engine"))))
