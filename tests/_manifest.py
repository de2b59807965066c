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
)

BY_ID = {d.id: d for d in DRILLS}
BY_STEM = {d.stem: d for d in DRILLS}


def drill(key):
    """Look a drill up by id ('l1') or stem ('l1_paged_kv_write')."""
    found = BY_ID.get(key.lower()) or BY_STEM.get(key)
    if found is None:
        raise KeyError(f"no drill {key!r}; known: {', '.join(BY_ID)}")
    return found
