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


def measure(module, device="cuda", params=_PARAMS):
    """One timed run each (a whole generate is seconds: no repeats), after a small warm-up
    that compiles the kernels: the engine's and transformers' tokens/s, and the engine's
    decode step, (T(new) - T(1)) / (new - 1), against its floor (bytes over the ceiling)."""
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

    def engine(new, rows=params["num_seqs"]):
        return lambda: module.generate(model, prompts[:rows].tolist(), new, block_size=16,
                                       max_num_batched_tokens=params["budget"])

    def hf(new, rows=params["num_seqs"]):
        def run():
            with torch.no_grad():
                p = prompts[:rows].to(device)
                model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
        return run
    timed(engine(2, 2)), timed(hf(2, 2))  # compile and warm
    full, one = timed(engine(params["new"])), timed(engine(1))
    theirs = timed(hf(params["new"]))
    tokens = params["num_seqs"] * params["new"]
    step = (full - one) / (params["new"] - 1)
    floor = BENCH[0].bytes / (copy_ceiling_gbps() * 1e9)
    return dict(engine_tokens_per_s=round(tokens / full), transformers_tokens_per_s=round(tokens / theirs),
                speedup=round(theirs / full, 2), engine_s=round(full, 2), transformers_s=round(theirs, 2),
                prefill_s=round(one, 3), decode_step_ms=round(step * 1e3, 2), decode_floor_ms=round(floor * 1e3, 2))


if __name__ == "__main__":
    import json

    from _tree import load_drill
    print(json.dumps(measure(load_drill("solutions", "e1_paged_engine"))))
