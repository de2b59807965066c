"""The drills, in order. The grader, the tests, the README table and the bench read
this list; adding a drill is adding an entry here plus its four files.

Test shapes bound what the hypothesis strategies in _paged.py draw (kept small:
under the CPU interpreter every program runs in Python). Bench cases are the
shapes the bandwidth report times on a GPU, each with the fewest bytes it must
move (every input read once, every output written once).
"""
from dataclasses import dataclass, field

ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class BenchCase:
    name: str
    params: dict
    bytes: int        # fewest bytes through device memory
    flops: int = 0
    graph: bool = False  # short op: time CUDA-graph replays, not single launches


@dataclass(frozen=True)
class Drill:
    id: str
    stem: str
    title: str
    mirrors: str      # what it is in vLLM / FlashInfer
    api: tuple        # public names of the module, in the order the page teaches them
    test_shapes: dict = field(default_factory=dict)
    bench: tuple = ()

    @property
    def page(self):
        return f"content/{self.id}.md"

    @property
    def files(self):
        return (self.page, f"mine/{self.stem}.py", f"solutions/{self.stem}.py", f"tests/test_{self.stem}.py")


def kv_write_bytes(num_tokens, num_heads, head_size, dtype, num_padding=0, **_):
    """L1: each real token's K and V read once and written once, plus its slot."""
    real = num_tokens - num_padding
    return 2 * 2 * real * num_heads * head_size * ELEMENT_SIZE[dtype] + 8 * num_tokens


def _kv_write_case(num_tokens, graph):
    params = dict(num_tokens=num_tokens, num_heads=8, head_size=128, block_size=16,
                  num_blocks=65536, dtype="float16")  # 2 GiB per cache
    return BenchCase(f"T={num_tokens}", params, kv_write_bytes(**params), graph=graph)


# --- L2: paged decode attention


def decode_bytes(num_seqs, num_heads, num_kv_heads, head_size, context, block_size, dtype, **_):
    """L2: the K and V of every cached token read once, the query read and the output
    written once, plus each sequence's block-table row and length."""
    size = ELEMENT_SIZE[dtype]
    kv = 2 * num_seqs * context * num_kv_heads * head_size * size
    q_and_out = 2 * num_seqs * num_heads * head_size * size
    return kv + q_and_out + 4 * num_seqs * -(-context // block_size) + 4 * num_seqs


def decode_flops(num_seqs, num_heads, context, head_size, **_):
    """L2: q·k and p·v, a multiply and an add each, per query head and cached token."""
    return 4 * num_seqs * num_heads * context * head_size


def _decode_case(num_seqs, graph):
    params = dict(num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, context=4096, block_size=16,
                  dtype="float16")
    return BenchCase(f"B={num_seqs}", params, decode_bytes(**params), decode_flops(**params), graph=graph)


DRILLS = (
    Drill(
        id="l1",
        stem="l1_paged_kv_write",
        title="Paged KV-cache write",
        mirrors="vLLM reshape_and_cache_flash",
        api=("slot_mapping", "reshape_and_cache_kernel", "reshape_and_cache"),
        test_shapes=dict(max_seqs=4, max_new_tokens=6, max_context=40, max_heads=4,
                         head_sizes=(1, 3, 8, 16, 24, 40), block_sizes=(1, 2, 3, 4, 8, 16, 32),
                         max_padding=3),
        bench=(_kv_write_case(4096, graph=True), _kv_write_case(65536, graph=False)),
    ),
    Drill(
        id="l2",
        stem="l2_paged_decode",
        title="Paged decode attention",
        mirrors="vLLM paged attention v1 / Triton decode",
        api=("paged_decode_kernel", "paged_decode_attention"),
        test_shapes=dict(max_seqs=4, max_context=200, max_kv_heads=2, gqa_ratios=(1, 4, 8),
                         head_sizes=(3, 8, 16, 24, 40), block_sizes=(16, 32)),
        # B=64 moves 1 GiB (about 250 us at 4.3 TB/s); B=8 moves 128 MiB, short enough that launch gaps count.
        bench=(_decode_case(64, graph=False), _decode_case(8, graph=True)),
    ),
)

BY_ID = {d.id: d for d in DRILLS}
BY_STEM = {d.stem: d for d in DRILLS}


def drill(key):
    """Look a drill up by id ('l1') or stem ('l1_paged_kv_write')."""
    found = BY_ID.get(key.lower()) or BY_STEM.get(key)
    if found is None:
        raise KeyError(f"no drill {key!r}; known: {', '.join(BY_ID)}")
    return found
