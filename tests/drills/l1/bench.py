"""L1's bench: its cases (`BENCH`), the fewest bytes a write moves, and the work the
bandwidth report times (ours against torch's index_copy_)."""
import torch

from _drill import ELEMENT_SIZE, BenchCase
from _paged import DTYPES


def kv_write_bytes(num_tokens, num_heads, head_size, dtype, num_padding=0, **_):
    """Each real token's K and V read once and written once, plus its slot."""
    real = num_tokens - num_padding
    return 2 * 2 * real * num_heads * head_size * ELEMENT_SIZE[dtype] + 8 * num_tokens


def _bench_case(num_tokens, graph):
    params = dict(num_tokens=num_tokens, num_heads=8, head_size=128, block_size=16,
                  num_blocks=65536, dtype="float16")  # 2 GiB per cache
    return BenchCase(f"T={num_tokens}", params, kv_write_bytes(**params), graph=graph)


BENCH = (_bench_case(4096, graph=True), _bench_case(65536, graph=False))


def bench_work(module, params, device, n_sets):
    """`n_sets` independent writes into one pair of caches, for the bandwidth report.

    Each set scatters its tokens over different random slots of a multi-GB cache,
    so the L2 cache holds neither the inputs nor the lines being written.
    Returns (ours, {name: (baseline, graph_safe)}): callables that each run all sets once.
    """
    num_tokens, block_size, num_blocks = params["num_tokens"], params["block_size"], params["num_blocks"]
    num_heads, head_size, dtype = params["num_heads"], params["head_size"], DTYPES[params["dtype"]]
    k_cache = torch.empty((num_blocks, block_size, num_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=device)[:n_sets * num_tokens].view(n_sets, num_tokens)
    sets = [(torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
             torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
             slots[i].contiguous()) for i in range(n_sets)]

    def ours():
        for key, value, slot in sets:
            module.reshape_and_cache(key, value, k_cache, v_cache, slot)

    def index_copy():
        # What you would write without a kernel: mask out padding, then one
        # index_copy_ per cache into the flattened [slots, H*D] view.
        hd = num_heads * head_size
        for key, value, slot in sets:
            real = slot >= 0
            slot = slot[real]
            k_cache.view(-1, hd).index_copy_(0, slot, key[real].view(-1, hd))
            v_cache.view(-1, hd).index_copy_(0, slot, value[real].view(-1, hd))

    # Boolean-mask indexing syncs with the host, so this baseline cannot be captured in a CUDA graph.
    return ours, {"torch index_copy_": (index_copy, False)}
