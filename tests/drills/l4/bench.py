"""L4's bench: the bytes and FLOPs of a split decode, bench_work (ours against L2's
reference and SDPA on contiguous K/V), and the bench cases BENCH."""
import torch

from _drill import BenchCase
from _paged import DTYPES
from _tree import load_drill


# ---------------------------------------------------------------------------
# The bench work


def split_bytes(num_seqs, num_heads, num_kv_heads, head_size, context, dtype, **_):
    """Every cached K and V read once, the query read and the output written once
    (BENCHMARKS.md counts the same; the block table and seq_lens are left out)."""
    size = DTYPES[dtype].itemsize
    return 2 * num_seqs * context * num_kv_heads * head_size * size + 2 * num_seqs * num_heads * head_size * size


def split_flops(num_seqs, num_heads, context, head_size, **_):
    return 4 * num_seqs * num_heads * context * head_size


def bench_work(module, params, device, n_sets):
    """`n_sets` decode steps over one block pool, no two sharing a block, so the L2
    cache holds none of them. Returns (ours, {name: (baseline, graph_safe)}): L2's
    reference (loaded from solutions/, whatever tree is graded) and SDPA on the same
    K/V already contiguous per sequence."""

    num_seqs, context, block_size = params["num_seqs"], params["context"], params["block_size"]
    num_heads, num_kv_heads, head_size = params["num_heads"], params["num_kv_heads"], params["head_size"]
    dtype = DTYPES[params["dtype"]]
    blocks_per_seq = -(-context // block_size)
    num_blocks = n_sets * num_seqs * blocks_per_seq
    k_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    sets = [(torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous(),
             torch.empty(num_seqs, num_heads, head_size, dtype=dtype, device=device)) for i in range(n_sets)]
    l2 = load_drill("solutions", "l2_paged_decode")

    def ours():
        for query, table, out in sets:
            module.paged_decode_attention_split(query, k_cache, v_cache, table, seq_lens, out=out)

    def l2_reference():
        for query, table, _ in sets:
            l2.paged_decode_attention(query, k_cache, v_cache, table, seq_lens)

    def gathered(cache, table):
        return cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    contiguous = [(q.unsqueeze(2), gathered(k_cache, t), gathered(v_cache, t)) for q, t, _ in sets]

    def sdpa_contiguous():
        for query, k, v in contiguous:
            torch.nn.functional.scaled_dot_product_attention(query, k, v, enable_gqa=True)

    return ours, {"L2 (solutions)": (l2_reference, True), "SDPA, contiguous KV": (sdpa_contiguous, True)}


def _bench_case(num_seqs, context, graph):
    params = dict(num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, context=context, block_size=16,
                  dtype="float16")
    return BenchCase(f"B={num_seqs} ctx={context}", params, split_bytes(**params), split_flops(**params), graph=graph)


# B=8 at 4096 moves 128 MiB (about 31 us at 4.3 TB/s): short, so graph replays. The other two move 1 GiB.
BENCH = (_bench_case(8, 4096, graph=True), _bench_case(8, 32768, graph=False), _bench_case(64, 4096, graph=False))
