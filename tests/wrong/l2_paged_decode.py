"""Known-wrong variants of solutions/l2_paged_decode.py, one per pitfall on
content/l2.md §7: what the mistake is (`says`, shown by the grader when a
learner's output matches the variant's) and the (exact text, replacement)
edits that plant it in the reference. tests/_wrong.py builds them;
tests/test_wrong.py proves the tests catch and name every one."""

SECTION = "content/l2.md §7"

_WHOLE_LAST_BLOCK = "pos < tl.cdiv(seq_len, BLOCK_SIZE) * BLOCK_SIZE"
_WHOLE_ROW = "pos < table_stride * BLOCK_SIZE"

PITFALLS = {
    "no_last_block_mask": dict(says="the tokens past seq_len in the last block are not masked out of the softmax", edits=[
        ("live = pos < seq_len", f"live = {_WHOLE_LAST_BLOCK}"),
    ]),
    "unmasked_loads": dict(says="K/V are loaded for the whole last block; only the scores are masked, and 0 * NaN = NaN", edits=[
        ("pos // BLOCK_SIZE, mask=live, other=0)", f"pos // BLOCK_SIZE, mask={_WHOLE_LAST_BLOCK}, other=0)"),
        ("kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]",
         f"kv_mask = ({_WHOLE_LAST_BLOCK})[:, None] & (dims < HEAD_SIZE)[None, :]"),
    ]),
    "reads_past_seq_len": dict(says="the whole block-table row is read, garbage columns past ceil(seq_len / block_size) included", edits=[
        ("pos // BLOCK_SIZE, mask=live, other=0)", f"pos // BLOCK_SIZE, mask={_WHOLE_ROW}, other=0)"),
        ("kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]",
         f"kv_mask = ({_WHOLE_ROW})[:, None] & (dims < HEAD_SIZE)[None, :]"),
    ]),
    "off_by_one": dict(says="only seq_len - 1 tokens are attended: seq_len already counts the new token", edits=[
        ("live = pos < seq_len", "live = pos < seq_len - 1"),
    ]),
    "wrong_gqa_mapping": dict(says="query head h is paired with KV head h % H_kv instead of h // (H_q / H_kv)", edits=[
        ("heads = kv_head * GROUP + rows", "heads = kv_head + rows * NUM_KV_HEADS"),
    ]),
    "missing_scale": dict(says="the scores are not multiplied by scale", edits=[
        ('s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale', 's = tl.dot(q, tl.trans(k), input_precision="ieee")'),
    ]),
    "no_running_max": dict(says="the softmax takes exp of the raw scores, without subtracting the running max", edits=[
        ("m_new = tl.maximum(m, tl.max(s, axis=1))", "m_new = tl.zeros([GROUP_PAD], tl.float32)"),
    ]),
    "no_rescale": dict(says="the running sum and accumulator are not rescaled by exp(m_old - m_new) when the max grows", edits=[
        ("alpha = tl.exp(m - m_new)", "alpha = tl.full([GROUP_PAD], 1.0, tl.float32)"),
    ]),
    "unmasked_head_size": dict(says="the query's padded lanes past D are loaded without a mask", edits=[
        ("                mask=q_mask, other=0.0)", "                mask=(rows < GROUP)[:, None] & (dims < D_PAD)[None, :], other=0.0)"),
    ]),
    "query_stride_ignored": dict(says="query rows are read H_q*D apart instead of query.stride(0) apart, so fused-QKV views read the wrong rows", edits=[
        ("query_ptr + seq * query_stride + heads", "query_ptr + seq * NUM_HEADS * HEAD_SIZE + heads"),
    ]),
    "int32_offsets": dict(says="cache offsets are computed in int32 and wrap around once slot * H_kv * D passes 2**31", edits=[
        ("seq = tl.program_id(0).to(tl.int64)", "seq = tl.program_id(0)"),
        ("kv_head = tl.program_id(1).to(tl.int64)", "kv_head = tl.program_id(1)"),
        ("slot = block.to(tl.int64) * BLOCK_SIZE", "slot = block.to(tl.int32) * BLOCK_SIZE"),
    ]),
}
