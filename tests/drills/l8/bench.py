"""Drill L8's bench workload: the bytes and FLOPs over the window (not the context), the
bench cases (BENCH) and bench_work, which times them against L4 and L3 over the whole
context (the same step without a window)."""
import torch

from _drill import ELEMENT_SIZE, BenchCase
from _paged import DTYPES
from _tree import load_drill


def window_keys(q_len, context, window_left):
    """Keys the queries of one sequence see, summed: query i (position context + i) sees
    min(position + 1, window_left + 1) of them."""
    w = float("inf") if window_left < 0 else window_left + 1
    return sum(int(min(context + i + 1, w)) for i in range(q_len))


def window_flops(num_seqs, q_len, context, window_left, num_heads, head_size, **_):
    """q·k and p·v, a multiply and an add each, per query head and per key its window holds."""
    return 4 * num_seqs * num_heads * head_size * window_keys(q_len, context, window_left)


def window_bytes(num_seqs, q_len, context, window_left, num_heads, num_kv_heads, head_size, dtype, **_):
    """The keys some query's window holds, K and V read once; the query read and the output
    written once (the block table, the lengths and the sinks left out, as L4 does)."""
    seq_len = context + q_len
    first = 0 if window_left < 0 else max(context - window_left, 0)
    size = ELEMENT_SIZE[dtype]
    return 2 * num_seqs * (seq_len - first) * num_kv_heads * head_size * size + \
        2 * num_seqs * q_len * num_heads * head_size * size


def _case(name, graph=False, **params):
    params = dict(dict(block_size=16, dtype="float16", sinks=True), **params)
    return BenchCase(name, params, window_bytes(**params), window_flops(**params), graph=graph)


# gpt-oss's sliding layers at decode (H_q 64, H_kv 8, D 64, window 128, sinks, bf16): the
# window moves 17 MiB where the context would move 4 GiB. Mistral-like prefill (H_q 32,
# H_kv 8, D 128) at windows of 128 and 4096, and the whole causal context against L3.
BENCH = (
    _case("decode gpt-oss B=64 ctx 32768 w128", graph=True, decode=True, num_seqs=64, q_len=1, context=32767,
          window_left=127, num_heads=64, num_kv_heads=8, head_size=64, dtype="bfloat16"),
    _case("prefill 4x8192 w128", num_seqs=4, q_len=8192, context=0, window_left=127, num_heads=32,
          num_kv_heads=8, head_size=128),
    _case("prefill 4x8192 w4096", num_seqs=4, q_len=8192, context=0, window_left=4095, num_heads=32,
          num_kv_heads=8, head_size=128),
    _case("prefill 4x2048 no window", num_seqs=4, q_len=2048, context=0, window_left=-1, num_heads=32,
          num_kv_heads=8, head_size=128, sinks=False),
)


def bench_work(module, params, device, n_sets):
    """`n_sets` steps, each on its own blocks of one pool (the L2 cache holds none of the
    others'). The block table names only the blocks the window reaches; entries before are
    dead (-1), as vLLM's sliding-window manager leaves them. Baselines: the same step over
    the whole context by the references of L4 (decode) or L3 (prefill), on a second table
    whose every entry is live."""
    p = params
    dtype, bs = DTYPES[p["dtype"]], p["block_size"]
    seq_len = p["context"] + p["q_len"]
    per_seq = -(-seq_len // bs)
    first = 0 if p["window_left"] < 0 else max(p["context"] - p["window_left"], 0) // bs
    live = per_seq - first
    num_blocks = max(n_sets * p["num_seqs"] * live, p["num_seqs"] * per_seq)
    shape = (num_blocks, bs, p["num_kv_heads"], p["head_size"])
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = []
    for i in range(n_sets):
        table = torch.full((p["num_seqs"], per_seq), -1, dtype=torch.int32, device=device)
        table[:, first:] = pool[i * p["num_seqs"] * live:(i + 1) * p["num_seqs"] * live].view(p["num_seqs"], live)
        tables.append(table)
    full = pool[:p["num_seqs"] * per_seq].view(p["num_seqs"], per_seq).contiguous()
    rows = p["num_seqs"] * p["q_len"]
    queries = [torch.randn(rows, p["num_heads"], p["head_size"], dtype=dtype, device=device) for _ in range(n_sets)]
    sinks = torch.randn(p["num_heads"], device=device) if p["sinks"] else None
    seq_lens = torch.full((p["num_seqs"],), seq_len, dtype=torch.int32, device=device)
    starts = torch.arange(0, rows + 1, p["q_len"], dtype=torch.int32, device=device)
    outs = [torch.empty_like(q) for q in queries]
    if p.get("decode"):
        l4 = load_drill("solutions", "l4_split_kv_decode")

        def ours():
            for q, t, o in zip(queries, tables, outs):
                module.paged_decode_attention_window(q, k_cache, v_cache, t, seq_lens, p["window_left"], sinks, out=o)

        def whole():
            for q, o in zip(queries, outs):
                l4.paged_decode_attention_split(q, k_cache, v_cache, full, seq_lens, out=o)
        return ours, {"L4 (solutions), whole context": (whole, True)}
    l3 = load_drill("solutions", "l3_paged_prefill")

    def ours():
        for q, t, o in zip(queries, tables, outs):
            module.paged_prefill_attention_window(q, k_cache, v_cache, t, starts, seq_lens, p["window_left"], sinks,
                                                  out=o)

    def whole():
        for q, o in zip(queries, outs):
            l3.paged_prefill_attention(q, k_cache, v_cache, full, starts, seq_lens, out=o)
    return ours, {"L3 (solutions), whole context": (whole, True)}
