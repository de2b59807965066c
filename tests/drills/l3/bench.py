"""Drill L3's bench workload: the FLOPs and fewest bytes of a serving step, the bench cases
(BENCH) and bench_work, which times them against SDPA on contiguous K/V."""
import math

import torch

from _drill import ELEMENT_SIZE, BenchCase
from _paged import DTYPES


def prefill_flops(num_seqs, q_len, context, num_heads, head_size, **_):
    """q·k and p·v, a multiply and an add each, per query head and per key each query sees."""
    seen = sum(context + i + 1 for i in range(q_len))
    return 4 * num_seqs * num_heads * head_size * seen


def prefill_bytes(num_seqs, q_len, context, num_heads, num_kv_heads, head_size, block_size, dtype, **_):
    """Each sequence's K/V read once, the query read and the output written once, plus the
    block table and the two length arrays."""
    size = ELEMENT_SIZE[dtype]
    seq_len = context + q_len
    kv = 2 * num_seqs * seq_len * num_kv_heads * head_size * size
    q_and_out = 2 * num_seqs * q_len * num_heads * head_size * size
    return kv + q_and_out + 4 * num_seqs * -(-seq_len // block_size) + 4 * (2 * num_seqs + 1)


def _bench_case(name, num_seqs, q_len, context):
    params = dict(num_seqs=num_seqs, q_len=q_len, context=context, num_heads=32, num_kv_heads=8, head_size=128,
                  block_size=16, dtype="float16")
    return BenchCase(name, params, prefill_bytes(**params), prefill_flops(**params))


BENCH = (_bench_case("4x2048 causal", 4, 2048, 0), _bench_case("8x512 on 4096", 8, 512, 3584),
         _bench_case("decode B=64 ctx 4096", 64, 1, 4095))


def bench_work(module, params, device, n_sets):
    """`n_sets` serving steps over one block pool, for the report. Baseline: SDPA on the
    same K/V already contiguous, with the same (bottom-right) causal structure."""
    num_seqs, q_len, context = params["num_seqs"], params["q_len"], params["context"]
    num_heads, num_kv_heads, head_size, bs = (params[k] for k in ("num_heads", "num_kv_heads", "head_size",
                                                                  "block_size"))
    dtype = DTYPES[params["dtype"]]
    seq_len = context + q_len
    per_seq = math.ceil(seq_len / bs)
    num_blocks = n_sets * num_seqs * per_seq
    k_cache = torch.randn((num_blocks, bs, num_kv_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, per_seq)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    sets = [(torch.randn(num_seqs * q_len, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous())
            for i in range(n_sets)]
    mask = torch.arange(seq_len, device=device)[None, :] <= context + torch.arange(q_len, device=device)[:, None]

    def contiguous(cache, table):  # [B, H_q, seq_len, D]
        kv = cache[table.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2)
        return kv.repeat_interleave(num_heads // num_kv_heads, dim=1).contiguous()

    dense = [(q.view(num_seqs, q_len, num_heads, head_size).transpose(1, 2).contiguous(),
              contiguous(k_cache, t), contiguous(v_cache, t)) for q, t in sets]

    def ours():
        for query, table in sets:
            module.paged_prefill_attention(query, k_cache, v_cache, table, starts, seq_lens)

    def sdpa():
        for q, k, v in dense:
            if context == 0:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return ours, {"SDPA, contiguous KV": (sdpa, True)}
