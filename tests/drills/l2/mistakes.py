"""L2's planted mistakes: the pitfalls of content/l2.md §9 and the other wrong kernels,
as edits of the reference, and `PLANTED`, what the checks need of them."""
from _drill import Mistake, Pitfall, Planted

_WHOLE_LAST_BLOCK = "pos < tl.cdiv(seq_len, BLOCK_SIZE) * BLOCK_SIZE"
_WHOLE_ROW = "pos < table_stride * BLOCK_SIZE"

PITFALLS = {
    "no_last_block_mask": Pitfall(says="the tokens past seq_len in the last block are not masked out of the softmax", edits=[
        ("live = pos < seq_len", f"live = {_WHOLE_LAST_BLOCK}"),
    ]),
    "unmasked_loads": Pitfall(says="K/V are loaded for the whole last block; only the scores are masked, and 0 * NaN = NaN", edits=[
        ("pos // BLOCK_SIZE, mask=live, other=0)", f"pos // BLOCK_SIZE, mask={_WHOLE_LAST_BLOCK}, other=0)"),
        ("kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]",
         f"kv_mask = ({_WHOLE_LAST_BLOCK})[:, None] & (dims < HEAD_SIZE)[None, :]"),
    ]),
    "reads_past_seq_len": Pitfall(says="the whole block-table row is read, garbage columns past ceil(seq_len / block_size) included", edits=[
        ("pos // BLOCK_SIZE, mask=live, other=0)", f"pos // BLOCK_SIZE, mask={_WHOLE_ROW}, other=0)"),
        ("kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]",
         f"kv_mask = ({_WHOLE_ROW})[:, None] & (dims < HEAD_SIZE)[None, :]"),
    ], crashes=True),
    "off_by_one": Pitfall(says="only seq_len - 1 tokens are attended: seq_len already counts the new token", edits=[
        ("live = pos < seq_len", "live = pos < seq_len - 1"),
    ]),
    "wrong_gqa_mapping": Pitfall(says="query head h is paired with KV head h % H_kv instead of h // (H_q / H_kv)", edits=[
        ("heads = kv_head * GROUP + rows", "heads = kv_head + rows * NUM_KV_HEADS"),
    ]),
    "missing_scale": Pitfall(says="the scores are not multiplied by scale", edits=[
        ('s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale', 's = tl.dot(q, tl.trans(k), input_precision="ieee")'),
    ]),
    "no_running_max": Pitfall(says="the softmax takes exp of the raw scores, without subtracting the running max", edits=[
        ("m_new = tl.maximum(m, tl.max(s, axis=1))", "m_new = tl.zeros([GROUP_PAD], tl.float32)"),
    ]),
    "no_rescale": Pitfall(says="the running sum and accumulator are not rescaled by exp(m_old - m_new) when the max grows", edits=[
        ("alpha = tl.exp(m - m_new)", "alpha = tl.full([GROUP_PAD], 1.0, tl.float32)"),
    ]),
    "unmasked_head_size": Pitfall(says="the query's padded lanes past D are loaded without a mask", edits=[
        ("                mask=q_mask, other=0.0)", "                mask=(rows < GROUP)[:, None] & (dims < D_PAD)[None, :], other=0.0)"),
    ]),
    "query_stride_ignored": Pitfall(says="query rows are read H_q*D apart instead of query.stride(0) apart, so fused-QKV views read the wrong rows", edits=[
        ("query_ptr + seq * query_stride + heads", "query_ptr + seq * NUM_HEADS * HEAD_SIZE + heads"),
    ]),
    "int32_offsets": Pitfall(says="cache offsets are computed in int32 and wrap around once slot * H_kv * D passes 2**31", edits=[
        ("seq = tl.program_id(0).to(tl.int64)", "seq = tl.program_id(0)"),
        ("kv_head = tl.program_id(1).to(tl.int64)", "kv_head = tl.program_id(1)"),
        ("slot = block.to(tl.int64) * BLOCK_SIZE", "slot = block.to(tl.int32) * BLOCK_SIZE"),
    ], crashes=True),
}

_STORE = "tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)"

# Wrong kernels that are none of the page's pitfalls: the grade must fail each and
# name nothing, saying what is wrong instead.
MISTAKES = {
    "rescale_sign_flipped": Mistake(shows="every output is NaN or inf", edits=(
        ("alpha = tl.exp(m - m_new)", "alpha = tl.exp(m_new - m)"),
    )),
    "store_forgotten": Mistake(shows="never written", edits=(
        (_STORE, "pass  # planted: the store is forgotten"),
    )),
    "last_partial_block_dropped": Mistake(shows="only full blocks were read", edits=(
        ("live = pos < seq_len",
         "live = pos < tl.where(seq_len >= BLOCK_SIZE, seq_len // BLOCK_SIZE * BLOCK_SIZE, seq_len)"),
    )),
    "never_writes_last_head": Mistake(shows="never written", edits=(
        (_STORE, _STORE.replace("mask=q_mask", "mask=q_mask & (heads < NUM_HEADS - 1)[:, None]")),
    )),
    # GROUP_PAD rows hold GROUP live ones: unmasked, the spare rows load and store the heads after the group's.
    "spare_group_rows_unmasked": Mistake(shows="written past the end of out", edits=(
        ("q_mask = (rows < GROUP)[:, None] & (dims < HEAD_SIZE)[None, :]", "q_mask = (dims < HEAD_SIZE)[None, :]"),
    )),
    "writes_past_out": Mistake(shows="written past the end of out", edits=(
        (_STORE, _STORE.replace("mask=q_mask", "mask=(dims < HEAD_SIZE)[None, :]")),
    )),
}


PLANTED = Planted(id="l2", stem="l2_paged_decode", section="content/l2.md §9", pitfalls=PITFALLS, mistakes=MISTAKES)
