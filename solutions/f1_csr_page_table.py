"""F1 reference: FlashInfer's CSR page table and the append kernel that reads it.

Mirrors FlashInfer's `append_paged_kv_cache` and `get_batch_indices_positions`.
Read it next to content/f1.md, which explains it top to bottom and cites the
line ranges below.
"""
import torch
import triton
import triton.language as tl

LAYOUTS = ("NHD", "HND")


def block_table_to_csr(block_table, seq_lens, page_size):
    """The same pages as a block table, in CSR form: (kv_indptr, kv_indices, kv_last_page_len)."""
    _check_csr_inputs(block_table, seq_lens, page_size)
    num_pages = (seq_lens.long() + page_size - 1) // page_size  # pages each sequence owns
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int64, device=seq_lens.device)
    kv_indptr[1:] = num_pages.cumsum(0)  # row b's pages are kv_indices[indptr[b]:indptr[b+1]]
    # Keep the owned columns of every row, row after row: that is CSR's indices.
    owned = torch.arange(block_table.shape[1], device=block_table.device) < num_pages[:, None]
    kv_indices = block_table[owned]
    # 1..page_size for a sequence with pages (a full last page is page_size, not 0);
    # 0 for a sequence of length 0, which owns no page (as vLLM's FlashInfer backend does).
    kv_last_page_len = torch.where(seq_lens > 0, (seq_lens - 1) % page_size + 1, 0)
    return kv_indptr.int(), kv_indices.int(), kv_last_page_len.int()


def batch_indices_positions(append_indptr, seq_lens, nnz):
    """Sequence and position of each of the nnz appended tokens (FlashInfer's
    get_batch_indices_positions); seq_lens already count the appended tokens."""
    _check_append_indptr(append_indptr, seq_lens, nnz)
    token = torch.arange(nnz, dtype=torch.int32, device=append_indptr.device)
    # The sequence of token t is the b with indptr[b] <= t < indptr[b+1]: count the
    # ends indptr[1:] that are <= t. Empty sequences repeat an end and get no token.
    batch = torch.searchsorted(append_indptr[1:], token, right=True, out_int32=True)
    past_end = batch == len(seq_lens)  # t >= indptr[-1]: padding, as in a CUDA graph
    append_len = append_indptr[1:] - append_indptr[:-1]
    # Sequence b's new tokens start at seq_len - append_len; padding (b = B) reads an appended 0.
    seq_lens_, append_len_ = (torch.cat([t, t.new_zeros(1)]) for t in (seq_lens, append_len))
    positions = seq_lens_[batch] - append_len_[batch] + (token - append_indptr[batch])
    return torch.where(past_end, -1, batch).int(), torch.where(past_end, 0, positions).int()


@triton.jit
def append_paged_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr,
    batch_indices_ptr, positions_ptr, kv_indices_ptr, kv_indptr_ptr,
    key_stride_n, key_stride_h, value_stride_n, value_stride_h,  # append_key/value [nnz, H, D]
    stride_page, stride_entry, stride_head,  # the cache's; the layout decided which dim is which
    page_size, H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # next powers of two >= H and >= D
):
    token = tl.program_id(axis=0).to(tl.int64)
    b = tl.load(batch_indices_ptr + token)
    if b < 0:  # padding: this drill skips batch index -1 (FlashInfer has no such guard)
        return
    pos = tl.load(positions_ptr + token)
    # The look-up L1 did on the host: which page of the pool holds this position?
    page_iter = tl.load(kv_indptr_ptr + b) + pos // page_size
    # Widen before the multiply: page * stride_page passes 2**31 in a large cache.
    page = tl.load(kv_indices_ptr + page_iter).to(tl.int64)
    entry = pos % page_size
    heads = tl.arange(0, BLOCK_H)[:, None]  # one token's [H, D] as a 2-D tile
    feats = tl.arange(0, BLOCK_D)[None, :]
    keep = (heads < H) & (feats < D)
    k = tl.load(key_ptr + token * key_stride_n + heads * key_stride_h + feats, mask=keep)
    v = tl.load(value_ptr + token * value_stride_n + heads * value_stride_h + feats, mask=keep)
    # paged_kv_t::get_k_ptr(page, head, entry, feat) of FlashInfer, from the strides.
    dst = page * stride_page + entry * stride_entry + heads * stride_head + feats
    tl.store(k_cache_ptr + dst, k, mask=keep)
    tl.store(v_cache_ptr + dst, v, mask=keep)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD"):
    """Write append_key/append_value [nnz, H, D] into the paged cache, in place.

    kv_last_page_len is checked on the CPU but the kernel never reads it.
    """
    k_cache, v_cache = _unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    _check_append_inputs(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                         kv_indices, kv_indptr, kv_last_page_len, kv_layout)
    nnz, num_heads, head_size = append_key.shape
    if nnz == 0:
        return
    # The only place the layout matters: which cache dim is the entry and which the head.
    if kv_layout == "NHD":  # [num_pages, page_size, H, D]
        page_size, stride_entry, stride_head = k_cache.shape[1], k_cache.stride(1), k_cache.stride(2)
    else:                   # [num_pages, H, page_size, D]
        page_size, stride_entry, stride_head = k_cache.shape[2], k_cache.stride(2), k_cache.stride(1)
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_size)
    append_paged_kv_cache_kernel[(nnz,)](
        append_key, append_value, k_cache, v_cache, batch_indices, positions, kv_indices, kv_indptr,
        append_key.stride(0), append_key.stride(1), append_value.stride(0), append_value.stride(1),
        k_cache.stride(0), stride_entry, stride_head, page_size, num_heads, head_size,
        # 2 warps for a 1024-value token: 16 fp16 per thread (BENCHMARKS.md, F1).
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 512)),
    )


def _unpack_paged_kv_cache(paged_kv_cache, kv_layout):
    """(k_cache, v_cache), each 4-D in kv_layout, from a (k, v) tuple or one 5-D tensor."""
    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(f"a single paged_kv_cache tensor must be 5-D with K then V in dim 1 "
                             f"([num_pages, 2, page_size, H, D] for NHD); got shape {tuple(paged_kv_cache.shape)}")
        return paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        return tuple(paged_kv_cache)
    raise ValueError(f"paged_kv_cache must be a (k_cache, v_cache) tuple or one 5-D tensor, "
                     f"got {type(paged_kv_cache).__name__}")


# --- input checks -----------------------------------------------------------
# Value checks (indptr order, ranges) read the tensors' contents. On the CPU that
# is free; on a GPU each would cost a device-to-host sync every step, so there
# (as in FlashInfer) the kernel trusts its caller.


def _int32(name, t, dim=1):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dim:
        what = f"{t.dtype} tensor of {t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dim}-D int32 tensor (FlashInfer's index type), got {what}; "
                         f"pass {name}.int()")


def _same_device(**tensors):
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(f"all tensors must be on one device; got "
                         f"{ {name: str(t.device) for name, t in tensors.items()} }")


def _check_indptr(name, indptr):
    """indptr [B+1] starts at 0 and never decreases (CPU only)."""
    if indptr.device.type == "cpu" and len(indptr) > 0:
        steps = indptr[1:] - indptr[:-1]
        if int(indptr[0]) != 0 or bool((steps < 0).any()):
            raise ValueError(f"{name} must start at 0 and be non-decreasing (row b is [{name}[b], {name}[b+1])); "
                             f"got {indptr.tolist()[:16]}")


def _check_csr_inputs(block_table, seq_lens, page_size):
    _int32("block_table", block_table, dim=2)
    _int32("seq_lens", seq_lens)
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if len(seq_lens) != block_table.shape[0]:
        raise ValueError(f"seq_lens has {len(seq_lens)} entries but block_table has {block_table.shape[0]} rows")
    _same_device(block_table=block_table, seq_lens=seq_lens)
    if seq_lens.device.type == "cpu" and len(seq_lens) > 0:
        need = -(-int(seq_lens.max()) // page_size)
        if int(seq_lens.min()) < 0 or need > block_table.shape[1]:
            raise ValueError(f"seq_lens must lie in 0..{block_table.shape[1] * page_size} (block_table has "
                             f"{block_table.shape[1]} columns of {page_size}); got {seq_lens.tolist()[:16]}")


def _check_append_indptr(append_indptr, seq_lens, nnz):
    _int32("append_indptr", append_indptr)
    _int32("seq_lens", seq_lens)
    if len(append_indptr) != len(seq_lens) + 1:
        raise ValueError(f"append_indptr must have len(seq_lens) + 1 = {len(seq_lens) + 1} entries, "
                         f"got {len(append_indptr)}")
    if not isinstance(nnz, int) or nnz < 0:
        raise ValueError(f"nnz must be a non-negative int, got {nnz!r}")
    _same_device(append_indptr=append_indptr, seq_lens=seq_lens)
    _check_indptr("append_indptr", append_indptr)
    if append_indptr.device.type == "cpu":
        if int(append_indptr[-1]) > nnz:
            raise ValueError(f"nnz = {nnz} is smaller than append_indptr[-1] = {int(append_indptr[-1])}, "
                             f"the number of appended tokens")
        append_len = append_indptr[1:] - append_indptr[:-1]
        if bool((seq_lens < append_len).any()):
            raise ValueError("seq_lens count the appended tokens, so seq_lens[b] >= append_indptr[b+1] - "
                             f"append_indptr[b]; got seq_lens {seq_lens.tolist()[:16]}, "
                             f"appended {append_len.tolist()[:16]}")


def _check_append_inputs(key, value, batch_indices, positions, k_cache, v_cache,
                         kv_indices, kv_indptr, kv_last_page_len, kv_layout):
    # The kernel reads a token as [H, D] from (row, head) strides with the
    # feature dim contiguous, and writes each cache through its own strides.
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"append_key and append_value must both be [nnz, H, D]; "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k and v caches must be 4-D with one shape and one set of strides; got shapes "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}, "
                         f"strides {k_cache.stride()}, {v_cache.stride()}")
    heads = (k_cache.shape[2], k_cache.shape[3]) if kv_layout == "NHD" else (k_cache.shape[1], k_cache.shape[3])
    if heads != tuple(key.shape[1:]):
        raise ValueError(f"the {kv_layout} cache {tuple(k_cache.shape)} holds (H, D) = {heads}, "
                         f"but append_key has {tuple(key.shape[1:])}")
    dtypes = {key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}
    if len(dtypes) != 1 or key.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"append_key, append_value and the cache must share one of float16, bfloat16, "
                         f"float32; got {key.dtype}, {value.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("append_key", key), ("append_value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim (D) must be contiguous, got strides {t.stride()}")
    for name, t in (("batch_indices", batch_indices), ("positions", positions), ("kv_indices", kv_indices),
                    ("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len)):
        _int32(name, t)
    if len(batch_indices) != key.shape[0] or len(positions) != key.shape[0]:
        raise ValueError(f"batch_indices and positions need one entry per appended token ({key.shape[0]}); "
                         f"got {len(batch_indices)} and {len(positions)}")
    if len(kv_indptr) != len(kv_last_page_len) + 1:
        raise ValueError(f"kv_indptr must have len(kv_last_page_len) + 1 = {len(kv_last_page_len) + 1} entries, "
                         f"got {len(kv_indptr)}")
    _same_device(append_key=key, append_value=value, batch_indices=batch_indices, positions=positions,
                 k_cache=k_cache, v_cache=v_cache, kv_indices=kv_indices, kv_indptr=kv_indptr,
                 kv_last_page_len=kv_last_page_len)
    if kv_indptr.device.type == "cpu":
        _check_page_table(batch_indices, positions, k_cache, kv_indices, kv_indptr, kv_last_page_len, kv_layout)


def _check_page_table(batch_indices, positions, k_cache, kv_indices, kv_indptr, kv_last_page_len, kv_layout):
    """The CSR table and every token's (sequence, position) against it (CPU only)."""
    _check_indptr("kv_indptr", kv_indptr)
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1 if kv_layout == "NHD" else 2]
    if int(kv_indptr[-1]) > len(kv_indices):
        raise ValueError(f"kv_indptr[-1] = {int(kv_indptr[-1])} but kv_indices has only {len(kv_indices)} entries")
    used = kv_indices[:int(kv_indptr[-1])]
    if len(used) and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise ValueError(f"kv_indices must name pages 0..{num_pages - 1}; got values in "
                         f"[{int(used.min())}, {int(used.max())}]")
    pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    low = (pages > 0).int()  # a sequence with pages has a last page of 1..page_size tokens, else 0
    if bool(((kv_last_page_len < low) | (kv_last_page_len > page_size * low)).any()):
        raise ValueError(f"kv_last_page_len must be 1..{page_size} for a sequence with pages and 0 for one "
                         f"without; got {kv_last_page_len.tolist()[:16]} for page counts {pages.tolist()[:16]}")
    if bool((batch_indices >= len(kv_last_page_len)).any() | (batch_indices < -1).any()):
        raise ValueError(f"batch_indices must lie in 0..{len(kv_last_page_len) - 1} (or be -1 for padding); "
                         f"got {batch_indices.tolist()[:16]}")
    # Each real token's sequence length, as FlashInfer's get_seq_lens computes it (content/f1.md §4);
    # a padding token reads a 0 appended for it (an empty batch has nothing else to read).
    b = torch.where(batch_indices >= 0, batch_indices.long(), len(pages))
    seq_len = torch.cat([(pages - 1).clamp(min=0) * page_size + kv_last_page_len, pages.new_zeros(1)])[b]
    beyond = (batch_indices >= 0) & ((positions < 0) | (positions >= seq_len))
    if bool(beyond.any()):
        t = int(beyond.nonzero()[0])
        raise ValueError(f"token {t}: position {int(positions[t])} of sequence {int(batch_indices[t])} is beyond "
                         f"its allocated pages (kv_indptr and kv_last_page_len give it {int(seq_len[t])} tokens); "
                         f"kv_indptr/kv_last_page_len must already count the appended tokens")
