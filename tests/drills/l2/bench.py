"""L2's bench: the bench cases (`BENCH`), the fewest bytes and the FLOPs of a decode
step, and `bench_work`, the decode steps the bandwidth report times."""
import math

import torch

from _drill import ELEMENT_SIZE, BenchCase
from _paged import DTYPES


def decode_bytes(num_seqs, num_heads, num_kv_heads, head_size, context, block_size, dtype, **_):
    """The K and V of every cached token read once, the query read and the output
    written once, plus each sequence's block-table row and length."""
    size = ELEMENT_SIZE[dtype]
    kv = 2 * num_seqs * context * num_kv_heads * head_size * size
    q_and_out = 2 * num_seqs * num_heads * head_size * size
    return kv + q_and_out + 4 * num_seqs * -(-context // block_size) + 4 * num_seqs


def decode_flops(num_seqs, num_heads, context, head_size, **_):
    """q·k and p·v, a multiply and an add each, per query head and cached token."""
    return 4 * num_seqs * num_heads * context * head_size


def _bench_case(num_seqs, graph):
    params = dict(num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, context=4096, block_size=16,
                  dtype="float16")
    return BenchCase(f"B={num_seqs}", params, decode_bytes(**params), decode_flops(**params), graph=graph)


# B=64 moves 1 GiB (about 250 us at 4.3 TB/s); B=8 moves 128 MiB, short enough that launch gaps count.
BENCH = (_bench_case(64, graph=False), _bench_case(8, graph=True))


def bench_work(module, params, device, n_sets):
    """`n_sets` independent decode steps over one block pool, for the bandwidth report.

    Every sequence holds `context` tokens in blocks scattered at random over a
    pool no smaller than n_sets * B * context tokens, so no two sets share a block
    and the L2 cache holds none of them. Returns (ours, {name: (baseline, graph_safe)}).
    """
    num_seqs, context, block_size = params["num_seqs"], params["context"], params["block_size"]
    num_heads, num_kv_heads, head_size = params["num_heads"], params["num_kv_heads"], params["head_size"]
    dtype = DTYPES[params["dtype"]]
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = n_sets * num_seqs * blocks_per_seq
    k_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    sets = [(torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous())
            for i in range(n_sets)]

    def gathered(cache, table):
        # [B, max_blocks, block_size, H_kv, D] -> [B, H_kv, context, D], as SDPA wants it
        return cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2)

    def sdpa(query, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(query.unsqueeze(2), k, v, enable_gqa=True)
        return out.squeeze(2)

    # What paging should cost: nothing. The same K/V already contiguous per sequence.
    contiguous = [(q, gathered(k_cache, t).contiguous(), gathered(v_cache, t).contiguous()) for q, t in sets]

    def ours():
        for query, table in sets:
            module.paged_decode_attention(query, k_cache, v_cache, table, seq_lens)

    def gather_sdpa():
        # The naive paged baseline: copy each sequence's pages out, then attend.
        for query, table in sets:
            sdpa(query, gathered(k_cache, table), gathered(v_cache, table))

    def sdpa_contiguous():
        for query, k, v in contiguous:
            sdpa(query, k, v)

    return ours, {"gather + SDPA": (gather_sdpa, True), "SDPA, contiguous KV": (sdpa_contiguous, True)}
