"""L5's bench: the bytes of the fp8 decode and of the quantising write, bench_work (the
decode against L4's fp16 reference and gather + dequantise + SDPA; the write against
torch's quantise + index_copy_), and the bench cases BENCH."""
import torch

from _drill import BenchCase
from _paged import DTYPES
from _tree import load_drill


def decode_bytes(num_seqs, num_heads, num_kv_heads, head_size, context, block_size, dtype, **_):
    """K and V at 1 byte per element, the query read and the output written in the query's
    dtype, the two [H_kv] float32 scales, and 4 bytes per page of the block table."""
    size = DTYPES[dtype].itemsize
    pages = num_seqs * -(-context // block_size)
    return (2 * num_seqs * context * num_kv_heads * head_size + 2 * num_seqs * num_heads * head_size * size
            + 2 * 4 * num_kv_heads + 4 * pages)


def decode_flops(num_seqs, num_heads, context, head_size, **_):
    return 4 * num_seqs * num_heads * context * head_size


def write_bytes(num_tokens, num_heads, head_size, dtype, **_):
    """Each element of K and V read once (2 B) and written once (1 B), plus each token's slot."""
    return 2 * num_tokens * num_heads * head_size * (DTYPES[dtype].itemsize + 1) + 8 * num_tokens


def _decode_work(module, p, device, n_sets):
    num_seqs, context, block_size = p["num_seqs"], p["context"], p["block_size"]
    num_heads, num_kv_heads, head_size, dtype = p["num_heads"], p["num_kv_heads"], p["head_size"], DTYPES[p["dtype"]]
    blocks_per_seq = -(-context // block_size)
    num_blocks = n_sets * num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k16, v16 = torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)
    k_cache, v_cache = k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)
    k_scale = torch.full((num_kv_heads,), 0.5, device=device)
    v_scale = torch.full((num_kv_heads,), 0.25, device=device)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    sets = [(torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous(),
             torch.empty(num_seqs, num_heads, head_size, dtype=dtype, device=device)) for i in range(n_sets)]
    l4 = load_drill("solutions", "l4_split_kv_decode")

    def ours():
        for query, table, out in sets:
            module.paged_decode_attention_fp8(query, k_cache, v_cache, table, seq_lens, k_scale, v_scale, out=out)

    def l4_fp16():
        for query, table, out in sets:
            l4.paged_decode_attention_split(query, k16, v16, table, seq_lens, out=out)

    def gather_dequantise_sdpa():
        for query, table, _ in sets:
            def dense(cache, s):
                # gathered as bytes: indexing kernels do not all take fp8 dtypes
                x = cache.view(torch.uint8)[table.long()].view(cache.dtype).flatten(1, 2)[:, :context]
                x = x.to(dtype) * s.to(dtype)[None, None, :, None]
                return x.transpose(1, 2)
            torch.nn.functional.scaled_dot_product_attention(query.unsqueeze(2), dense(k_cache, k_scale),
                                                             dense(v_cache, v_scale), enable_gqa=True)

    return ours, {"L4 fp16 (solutions)": (l4_fp16, True), "gather + dequantise + SDPA": (gather_dequantise_sdpa, True)}


def _write_work(module, p, device, n_sets):
    num_tokens, block_size, num_blocks = p["num_tokens"], p["block_size"], p["num_blocks"]
    num_heads, head_size, dtype = p["num_heads"], p["head_size"], DTYPES[p["dtype"]]
    k_cache = torch.empty((num_blocks, block_size, num_heads, head_size), dtype=torch.float8_e4m3fn, device=device)
    v_cache = torch.empty_like(k_cache)
    k_scale, v_scale = torch.full((1,), 0.05, device=device), torch.full((1,), 0.04, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:n_sets * num_tokens].view(n_sets, num_tokens)
    sets = [(torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
             torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
             slots[i].contiguous()) for i in range(n_sets)]

    def ours():
        for key, value, slot in sets:
            module.reshape_and_cache_fp8(key, value, k_cache, v_cache, slot, k_scale, v_scale)

    def torch_quantise_index_copy():
        hd = num_heads * head_size
        for key, value, slot in sets:
            for x, cache, s in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
                q = (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                cache.view(torch.uint8).view(-1, hd).index_copy_(0, slot, q.view(torch.uint8).view(-1, hd))

    return ours, {"torch quantise + index_copy_": (torch_quantise_index_copy, True)}


def bench_work(module, params, device, n_sets):
    """`n_sets` independent calls over one large pool, so the L2 cache holds none of them.
    Returns (ours, {name: (baseline, graph_safe)})."""
    return (_write_work if params["op"] == "write" else _decode_work)(module, params, device, n_sets)


def _decode_case(num_seqs, context, graph):
    params = dict(op="decode", num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, context=context,
                  block_size=16, dtype="float16")
    return BenchCase(f"decode B={num_seqs} ctx={context}", params, decode_bytes(**params), decode_flops(**params),
                     graph=graph)


_WRITE = dict(op="write", num_tokens=65536, num_heads=8, head_size=128, block_size=16, num_blocks=65536,
              dtype="bfloat16")

# L4's decode shapes (B=8 at 4096 moves 64 MiB of fp8 K/V: short, so graph replays) and a
# write of 65536 tokens into 1 GiB fp8 caches.
BENCH = (_decode_case(8, 4096, graph=True), _decode_case(8, 32768, graph=False), _decode_case(64, 4096, graph=False),
         BenchCase("write T=65536", _WRITE, write_bytes(**_WRITE), graph=False))
