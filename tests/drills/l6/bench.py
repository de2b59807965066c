"""Drill L6's bench: the bytes and FLOPs of a cascade decode step, bench_work (ours against
L4's reference on the full block tables and SDPA on contiguous K/V), the bench cases
BENCH, and the crossover grid (batch x prefix) content/l6.md §5 reads from BENCHMARKS.md:

    cd tests && python -m drills.l6.bench          # on a GPU: the crossover table, markdown
"""
import torch

from _drill import ELEMENT_SIZE, BenchCase
from _paged import DTYPES
from _tree import load_drill


def suffix_lens(num_seqs, suffix, **_):
    """Each sequence's own tokens after the prefix (its new token included): `suffix`, or
    for a (lo, hi) pair an even spread from lo to hi."""
    if isinstance(suffix, int):
        return [suffix] * num_seqs
    lo, hi = suffix
    return [lo + (hi - lo) * b // max(1, num_seqs - 1) for b in range(num_seqs)]


def cascade_bytes(num_seqs, prefix, num_heads, num_kv_heads, head_size, dtype, **params):
    """The fewest bytes: the prefix's K/V once, each suffix's K/V once, q read and out
    written once (the block table, the lengths and the fp32 parts left out)."""
    size = ELEMENT_SIZE[dtype]
    kv_token = 2 * num_kv_heads * head_size * size
    rows = 2 * num_seqs * num_heads * head_size * size
    return prefix * kv_token + sum(suffix_lens(num_seqs, **params)) * kv_token + rows


def pass1_flops(num_seqs, prefix, num_heads, head_size, **_):
    """Pass 1's q·k and p·v: every query head of every decode row against every prefix key."""
    return 4 * num_seqs * num_heads * head_size * prefix


def cascade_flops(num_seqs, prefix, num_heads, head_size, **params):
    return pass1_flops(num_seqs, prefix, num_heads, head_size) + \
        4 * num_heads * head_size * sum(suffix_lens(num_seqs, **params))


def _step(params, device, n_sets):
    """n_sets decode steps over one block pool: the sets share nothing; within a set the
    prefix's blocks are the first columns of every row."""
    b, prefix, bs = params["num_seqs"], params["prefix"], params["block_size"]
    h, h_kv, d = params["num_heads"], params["num_kv_heads"], params["head_size"]
    dtype = DTYPES[params["dtype"]]
    own = suffix_lens(**params)
    p_blocks, width = prefix // bs, (prefix + max(own) + bs - 1) // bs
    per_set = p_blocks + sum(-(-n // bs) for n in own)
    k_cache = torch.randn((n_sets * per_set, bs, h_kv, d), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(n_sets * per_set, device=device).to(torch.int32)
    seq_lens = torch.tensor([prefix + n for n in own], dtype=torch.int32, device=device)
    starts = torch.arange(b + 1, dtype=torch.int32, device=device)
    sets = []
    for i in range(n_sets):
        blocks = pool[i * per_set:(i + 1) * per_set]
        table = torch.zeros((b, width), dtype=torch.int32, device=device)
        table[:, :p_blocks] = blocks[:p_blocks]
        at = p_blocks
        for row, n in enumerate(own):
            table[row, p_blocks:p_blocks + -(-n // bs)] = blocks[at:at + -(-n // bs)]
            at += -(-n // bs)
        sets.append((torch.randn(b, h, d, dtype=dtype, device=device), table,
                     torch.empty(b, h, d, dtype=dtype, device=device)))
    return k_cache, v_cache, starts, seq_lens, sets


def bench_work(module, params, device, n_sets):
    """Returns (ours, {name: (baseline, graph_safe)}): cascade_attention with the prefix
    read once; L4's reference (solutions/, whatever tree is graded) on the same full
    tables, reading the prefix once per sequence; SDPA on the same K/V made contiguous."""
    k_cache, v_cache, starts, seq_lens, sets = _step(params, device, n_sets)
    prefix, h, h_kv = params["prefix"], params["num_heads"], params["num_kv_heads"]
    l4 = load_drill("solutions", "l4_split_kv_decode")

    def ours():
        for query, table, out in sets:
            module.cascade_attention(query, k_cache, v_cache, table, starts, seq_lens, prefix, out=out)

    def l4_reference():
        for query, table, out in sets:
            l4.paged_decode_attention_split(query, k_cache, v_cache, table, seq_lens, out=out)

    longest = int(seq_lens.max())
    lens = seq_lens.tolist()

    def gathered(cache, table):  # [B, H_kv, longest, D], each row's tokens first
        return cache[table.long()].flatten(1, 2)[:, :longest].transpose(1, 2).contiguous()

    valid = torch.arange(longest, device=device)[None, :] < seq_lens[:, None]
    mask = valid[:, None, None, :]  # [B, 1, 1, keys]: unequal lengths need a mask
    dense = [(q.unsqueeze(2), gathered(k_cache, t), gathered(v_cache, t)) for q, t, _ in sets]

    def sdpa():
        for q, k, v in dense:
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None if min(lens) == longest else mask, enable_gqa=h != h_kv)

    return ours, {"L4 (solutions), full tables": (l4_reference, True), "SDPA, contiguous KV": (sdpa, True)}


def _bench_case(num_seqs, prefix, suffix, graph=False):
    params = dict(num_seqs=num_seqs, prefix=prefix, suffix=suffix, num_heads=32, num_kv_heads=8, head_size=128,
                  block_size=16, dtype="float16")
    tail = f"{suffix[0]}-{suffix[1]}" if isinstance(suffix, tuple) else suffix
    return BenchCase(f"B={num_seqs} prefix {prefix} + {tail}", params, cascade_bytes(**params),
                     cascade_flops(**params), graph=graph)


# The issue's decode shapes. The first is the target (>= 5x L4's reference, within 1.5x
# of the roofline); it moves about 81 MiB: short, so CUDA-graph replays time it.
BENCH = (_bench_case(64, 4096, 256, graph=True), _bench_case(128, 4096, 256, graph=True),
         _bench_case(64, 8192, 256, graph=True), _bench_case(128, 8192, (64, 512), graph=True))

# The crossover grid of content/l6.md §5 (measured on a GPU, recorded in BENCHMARKS.md).
CROSSOVER_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CROSSOVER_PREFIXES = (256, 512, 1024, 2048, 4096, 8192)
CROSSOVER_SUFFIX = 256


def crossover(module, device="cuda", batches=CROSSOVER_BATCHES, prefixes=CROSSOVER_PREFIXES,
              suffix=CROSSOVER_SUFFIX):
    """{(B, prefix): (cascade µs, L4 µs)} per decode step, median CUDA-graph replays."""
    from _bench import median_ms
    found = {}
    for b in batches:
        for prefix in prefixes:
            params = _bench_case(b, prefix, suffix).params
            n_sets = 4
            ours, baselines = bench_work(module, params, device, n_sets)
            l4 = baselines["L4 (solutions), full tables"][0]
            times = []
            for fn in (ours, l4):
                fn()
                torch.cuda.synchronize()
                times.append(round(median_ms(fn, True)[0] * 1e3 / n_sets, 1))
            found[(b, prefix)] = tuple(times)
            del ours, baselines
            torch.cuda.empty_cache()
    return found


def crossover_markdown(found):
    """The table BENCHMARKS.md records and content/l6.md §5 shows: L4 µs / cascade µs
    (above 1: cascade pays), one row per batch, one column per prefix length."""
    prefixes = sorted({p for _, p in found})
    lines = ["| B \\ prefix | " + " | ".join(str(p) for p in prefixes) + " |",
             "| --- |" + " --- |" * len(prefixes)]
    for b in sorted({b for b, _ in found}):
        lines.append(f"| {b} | " + " | ".join(f"{found[(b, p)][1] / found[(b, p)][0]:.2f}×" for p in prefixes) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    result = crossover(load_drill("solutions", "l6_cascade_attention"))
    for (b, p), (ours, l4) in sorted(result.items()):
        print(f"B={b} prefix={p} suffix={CROSSOVER_SUFFIX}: cascade {ours} µs, L4 {l4} µs")
    print(crossover_markdown(result))
