"""L7's bench: the bytes and FLOPs of an MLA decode step (FlashMLA's counts), bench_work
(ours against a plain PyTorch gather and two matmuls), and the bench cases BENCH."""
import torch

from _drill import BenchCase
from _paged import DTYPES


def mla_bytes(num_seqs, num_heads, rank, rope, context, dtype, total_tokens=None, **_):
    """The latent cache read once, q read once, out written once (vLLM's and FlashMLA's
    tests count the same; the block table, seq_lens and lse are left out)."""
    size = DTYPES[dtype].itemsize
    tokens = num_seqs * context if total_tokens is None else total_tokens
    return (tokens * (rank + rope) + num_seqs * num_heads * (rank + rope) + num_seqs * num_heads * rank) * size


def mla_flops(num_seqs, num_heads, rank, rope, context, total_tokens=None, **_):
    """2·H·S·(R + P) for the scores and 2·H·S·R for the weighted sum, over every token S."""
    tokens = num_seqs * context if total_tokens is None else total_tokens
    return 2 * num_heads * tokens * (rank + rope) + 2 * num_heads * tokens * rank


def _lengths(params, device):
    """seq_lens of the case: all `context`, or uniform in [1, context] (`varlen`, a fixed draw)."""
    num_seqs, context = params["num_seqs"], params["context"]
    if not params.get("varlen"):
        return torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(1000 + num_seqs)
    return torch.randint(1, context + 1, (num_seqs,), generator=gen, dtype=torch.int32).to(device)


def bench_work(module, params, device, n_sets):
    """`n_sets` decode steps over one shuffled block pool, no two sharing a block, so L2
    holds none of them. Returns (ours, {name: (baseline, graph_safe)}): the baseline is
    what you would write without a kernel: gather each sequence's latent rows into a padded
    [B, S, R + P] tensor, then bmm for the scores and bmm with its first R columns."""
    num_seqs, context, block_size = params["num_seqs"], params["context"], params["block_size"]
    num_heads, rank, rope, dtype = params["num_heads"], params["rank"], params["rope"], DTYPES[params["dtype"]]
    scale = 192 ** -0.5
    seq_lens = _lengths(params, device)
    blocks_per_seq = -(-context // block_size)
    num_blocks = n_sets * num_seqs * blocks_per_seq
    kv_cache = (torch.randn((num_blocks, block_size, rank + rope), dtype=dtype, device=device) / 10)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, blocks_per_seq)
    sets = [(torch.randn(num_seqs, num_heads, rank, dtype=dtype, device=device) / 10,
             torch.randn(num_seqs, num_heads, rope, dtype=dtype, device=device) / 10, pool[i].contiguous(),
             torch.empty(num_seqs, num_heads, rank, dtype=dtype, device=device)) for i in range(n_sets)]
    padded = blocks_per_seq * block_size
    invalid = torch.arange(padded, device=device)[None, None, :] >= seq_lens.long()[:, None, None]

    def ours():
        for q_nope, q_pe, table, out in sets:
            module.mla_decode_attention(q_nope, q_pe, kv_cache, table, seq_lens, scale, out=out)

    def gather_and_matmul():
        for q_nope, q_pe, table, _ in sets:
            rows = kv_cache[table.long()].view(num_seqs, padded, rank + rope)      # the gather: a copy
            s = torch.bmm(torch.cat((q_nope, q_pe), dim=-1), rows.transpose(1, 2)).float() * scale
            p = torch.softmax(s.masked_fill(invalid, float("-inf")), dim=-1)
            torch.bmm(p.to(dtype), rows[..., :rank])

    return ours, {"PyTorch gather + matmul": (gather_and_matmul, True)}


def _bench_case(num_seqs, num_heads, context, varlen=False, graph=False):
    params = dict(num_seqs=num_seqs, num_heads=num_heads, rank=512, rope=64, context=context, block_size=64,
                  dtype="bfloat16", varlen=varlen)
    total = int(_lengths(params, "cpu").sum())
    name = f"B={num_seqs} H={num_heads} " + (f"S~U[1,{context}]" if varlen else f"S={context}")
    return BenchCase(name, params, mla_bytes(**params, total_tokens=total), mla_flops(**params, total_tokens=total),
                     graph=graph)


# H = 16 (DeepSeek-V3 over 8 GPUs) does 2·16·(576 + 512) / 1152 = 30 FLOPs per cache byte: bound by
# memory, shown in GB/s. H = 128 does 242, past an H200's ridge (154 to 233, content/l7.md §4): TFLOP/s. Each case moves
# 0.3 to 1.2 GB of cache.
# B=64 H=16 runs in about 100 us on an H200, where the host's launch time shows: CUDA-graph replays.
BENCH = (_bench_case(64, 16, 4096, graph=True), _bench_case(64, 128, 4096), _bench_case(128, 16, 8192),
         _bench_case(128, 128, 8192), _bench_case(128, 16, 8192, varlen=True), _bench_case(128, 128, 8192, varlen=True))
