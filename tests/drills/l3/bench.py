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


def _bench_case(name, *groups):
    """A serving step of `groups`: (sequences, new tokens each, cached tokens each), in batch order."""
    params = dict(groups=groups, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="float16")
    shape = {k: v for k, v in params.items() if k != "groups"}
    flops = sum(prefill_flops(n, q, c, **shape) for n, q, c in groups)
    nbytes = sum(prefill_bytes(n, q, c, **shape) for n, q, c in groups)
    return BenchCase(name, params, nbytes, flops)


# The last case is the step a serving engine runs most: decode rows and prefill chunks in one batch.
BENCH = (_bench_case("4x2048 causal", (4, 2048, 0)), _bench_case("8x512 on 4096", (8, 512, 3584)),
         _bench_case("decode B=64 ctx 4096", (64, 1, 4095)),
         _bench_case("mixed: 60 decodes at 4096 + 4x512", (60, 1, 4095), (4, 512, 0)))


def bench_work(module, params, device, n_sets):
    """`n_sets` serving steps over one block pool, for the report. Baseline: SDPA on the same
    K/V already contiguous, with the same (bottom-right) causal structure, called once per
    kind of row: `enable_gqa=True` on [B, H, L, D] copies, the fastest honest call measured
    on an H200 (BENCHMARKS.md: it beat K/V expanded to H_q heads, and token-major views)."""
    num_heads, num_kv_heads, head_size, bs = (params[k] for k in ("num_heads", "num_kv_heads", "head_size",
                                                                  "block_size"))
    dtype = DTYPES[params["dtype"]]
    rows = [(q_len, context) for n, q_len, context in params["groups"] for _ in range(n)]
    num_seqs, total_q = len(rows), sum(q for q, _ in rows)
    per_seq = max(math.ceil((q + c) / bs) for q, c in rows)
    num_blocks = n_sets * num_seqs * per_seq
    k_cache = torch.randn((num_blocks, bs, num_kv_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, per_seq)
    q_lens = torch.tensor([q for q, _ in rows])
    starts = torch.cat((torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0))).to(torch.int32).to(device)
    seq_lens = torch.tensor([q + c for q, c in rows], dtype=torch.int32, device=device)
    sets = [(torch.randn(total_q, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous())
            for i in range(n_sets)]

    def dense(query, table):
        """One SDPA call's (q, k, v, mask, causal) per group of rows, all contiguous [n, H, L, D]."""
        calls, first, seq = [], 0, 0
        for n, q_len, context in params["groups"]:
            seq_len = q_len + context
            q = query[first:first + n * q_len].view(n, q_len, num_heads, head_size).transpose(1, 2).contiguous()
            kv = [cache[table[seq:seq + n].long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
                  for cache in (k_cache, v_cache)]
            mask = None
            if context > 0 and q_len > 1:  # bottom-right causal: SDPA's is_causal is top-left
                mask = torch.arange(seq_len, device=device)[None, :] <= context + torch.arange(q_len, device=device)[:, None]
            calls.append((q, *kv, mask, context == 0 and q_len > 1))
            first, seq = first + n * q_len, seq + n
        return calls

    steps = [dense(q, t) for q, t in sets]

    def ours():
        for query, table in sets:
            module.paged_prefill_attention(query, k_cache, v_cache, table, starts, seq_lens)

    def sdpa():
        for calls in steps:
            for q, k, v, mask, causal in calls:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                 enable_gqa=True)

    return ours, {"SDPA, contiguous KV": (sdpa, True)}
