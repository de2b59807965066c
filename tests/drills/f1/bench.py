"""Drill F1's bench: the workload's layout, its fewest bytes (append_bytes), the two
cases (BENCH) and bench_work, ours against a torch gather + index_put.
"""
import torch

from _drill import ELEMENT_SIZE, BenchCase
from _paged import DTYPES

from .reference import ref_batch_indices_positions, ref_block_table_to_csr

# ---------------------------------------------------------------------------
# Bench: 65536 tokens appended by 512 requests into 2 GiB caches.


def bench_layout(num_requests, new_tokens, page_size, seed=0, max_context=1200):
    """(context_lens, pages per request) of the bench workload, the same every time."""
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, max_context, (num_requests,), generator=gen)
    return context, (context + new_tokens + page_size - 1) // page_size


def append_bytes(num_requests, new_tokens, num_heads, head_size, page_size, dtype, **_):
    """K and V read once and written once, a batch index and a position per token, a kv_indptr
    entry per request and a kv_indices entry per page that receives tokens."""
    context, _pages = bench_layout(num_requests, new_tokens, page_size)
    touched = int(((context + new_tokens - 1) // page_size - context // page_size + 1).sum())
    tokens = num_requests * new_tokens
    kv = 4 * tokens * num_heads * head_size * ELEMENT_SIZE[dtype]
    return kv + 8 * tokens + 4 * (num_requests + 1) + 4 * touched


def _bench_case(kv_layout):
    params = dict(num_requests=512, new_tokens=128, num_heads=8, head_size=128, page_size=16, num_pages=65536,
                  dtype="float16", kv_layout=kv_layout)  # 2 GiB per cache
    return BenchCase(f"{kv_layout} nnz=65536", params, append_bytes(**params))


BENCH = (_bench_case("NHD"), _bench_case("HND"))


def bench_work(module, params, device, n_sets):
    """(ours, {name: (baseline, graph_safe)}): n_sets independent appends into one pair of caches."""
    page_size, layout, new = params["page_size"], params["kv_layout"], params["new_tokens"]
    num_requests, num_heads, head_size = params["num_requests"], params["num_heads"], params["head_size"]
    dtype = DTYPES[params["dtype"]]
    shape = ((params["num_pages"], page_size, num_heads, head_size) if layout == "NHD"
             else (params["num_pages"], num_heads, page_size, head_size))
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    context, pages = bench_layout(num_requests, new, page_size)
    seq_lens = (context + new).int()
    nnz = num_requests * new
    pool = torch.randperm(params["num_pages"])
    sets = []
    for i in range(n_sets):
        gen = torch.Generator().manual_seed(i)
        table = pool[torch.randperm(params["num_pages"], generator=gen)[:int(pages.max()) * num_requests]]
        table = table.view(num_requests, -1).int()
        kv_indptr, kv_indices, kv_last_page_len = ref_block_table_to_csr(table, seq_lens, page_size)
        append_indptr = torch.arange(0, nnz + 1, new, dtype=torch.int32)
        batch_indices, positions = ref_batch_indices_positions(append_indptr, seq_lens, nnz)
        key, value = (torch.randn(nnz, num_heads, head_size, dtype=dtype, device=device) for _ in range(2))
        sets.append(tuple(t.to(device) for t in (key, value, batch_indices, positions, kv_indices, kv_indptr,
                                                 kv_last_page_len)))

    def ours():
        for key, value, bi, pos, indices, indptr, last in sets:
            module.append_paged_kv_cache(key, value, bi, pos, (k_cache, v_cache), indices, indptr, last, layout)

    def index_put():
        # The page look-up as gathers, then one index_put per cache (no padding in this workload).
        for key, value, bi, pos, indices, indptr, _ in sets:
            p = pos.long()
            page = indices[indptr[bi.long()].long() + p // page_size].long()
            entry = p % page_size
            if layout == "NHD":
                k_cache[page, entry], v_cache[page, entry] = key, value
            else:  # advanced indices around a slice: the indexed view is [nnz, H, D]
                k_cache[page, :, entry], v_cache[page, :, entry] = key, value

    return ours, {"torch gather + index_put": (index_put, True)}
