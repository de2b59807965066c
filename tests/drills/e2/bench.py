"""E2's bench (a GPU run, recorded in BENCHMARKS.md, not a timed test): E1's 1 B-parameter
Llama shape with random bf16 weights.

- Shared system prompt: 64 requests, one 2048-token system prompt plus 64 tokens of their
  own each, 128 new tokens: tokens/s with caching on and off (the same engine) and
  transformers' batched generate; computed prompt tokens; cascade steps; time to first
  token (mean and p90, by hand only: it needs the engine's steps).
- Multi-turn: 16 chats x 4 turns in one call, turn k = turn k - 1, a 32-token reply and a
  32-token message: the share of prompt tokens reused, tokens/s on and off.
- The decode step with caching on against its floor (the weights, the shared prefix's
  K/V once, each request's own K/V).

`cd tests && python -m drills.e2.bench` runs everything on the reference; the grade's
row (bench_rows) times the shared-system-prompt workload once each way."""
import json
import sys
import time

import torch

from drills.e1.bench import MODEL, bench_model, weight_bytes

PARAMS = dict(num_seqs=64, system=2048, own=64, new=128, budget=8192)
CHATS = dict(chats=16, turns=4, first=256, reply=32, message=32, new=64, budget=8192)


def shared_prompts(p=PARAMS, vocab=MODEL["vocab"], seed=1):
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(1, vocab, (p["system"],), generator=gen).tolist()
    return [system + torch.randint(1, vocab, (p["own"],), generator=gen).tolist() for _ in range(p["num_seqs"])]


def chat_prompts(c=CHATS, vocab=MODEL["vocab"], seed=2):
    """Chat-major: chat i's turn k follows its turn k - 1 (first come, first served), so turn k
    finds turn k - 1's blocks cached."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(c["chats"]):
        turn = torch.randint(1, vocab, (c["first"],), generator=gen).tolist()
        for _ in range(c["turns"]):
            prompts.append(turn)
            turn = turn + torch.randint(1, vocab, (c["reply"] + c["message"],), generator=gen).tolist()
    return prompts


def decode_floor_bytes(p=PARAMS, shape=MODEL, size=2):
    """A decode step at the mean context with the shared prefix read once: the weights, the
    system prompt's K/V once, and each request's own tokens' K/V."""
    kv_token = 2 * shape["kv_heads"] * (shape["hidden"] // shape["heads"]) * size * shape["layers"]
    own = p["own"] + p["new"] // 2
    return weight_bytes(**{k: shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "vocab", "intermediate")},
                        size=size) + kv_token * (p["system"] + p["num_seqs"] * own)


def _timed(fn, what=""):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"{what or getattr(fn, '__name__', 'run')}: {seconds:.3f} s", file=sys.stderr, flush=True)  # kept if cut short
    return seconds, out


def measure(module, device="cuda", start=None, extras=True):
    """Each run timed once after a warm-up with the same workload. `module` is the tree's E2
    (in a worker for the grade); extras (by hand, on the reference in this process): TTFT,
    the decode step, the multi-turn workload."""
    from _bench import copy_ceiling_gbps
    model = bench_model(device)
    prompts, p = shared_prompts(), PARAMS
    tokens = p["num_seqs"] * p["new"]

    def engine(caching, new=p["new"], prompts=prompts, budget=p["budget"]):
        return lambda: module.generate(model, prompts, new, max_num_batched_tokens=budget,
                                       enable_prefix_caching=caching, return_stats=True)

    def hf():
        with torch.no_grad():
            ids = torch.tensor(prompts, device=device)
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=p["new"],
                           min_new_tokens=p["new"], do_sample=False)
    # Generate last: on a short lease the engine's own numbers come first (each printed as it
    # is measured, so a run cut short still says them).
    warm = [("warm on", engine(True)), ("warm off", engine(False))] + ([] if extras else [("warm generate", hf)])
    for what, fn in warm:  # the grade's start() expects everything warm; by hand generate warms last
        _timed(fn, what)  # warm: compiles, captures, prepares every shape
    ceiling = start() if start else copy_ceiling_gbps()
    on, (_, stats) = _timed(engine(True), "caching on")
    off, (_, stats_off) = _timed(engine(False), "caching off")
    print(f"stats on {stats}, off {stats_off}", file=sys.stderr, flush=True)
    result = dict(on_tokens_per_s=round(tokens / on), off_tokens_per_s=round(tokens / off),
                  on_over_off=round(off / on, 2), stats_on=stats, stats_off=stats_off,
                  computed_share=round(stats["computed_prompt_tokens"] / stats["prompt_tokens"], 4))
    if extras:
        one, _ = _timed(engine(True, new=1), "caching on, 1 new token")
        step = (on - one) / (p["new"] - 1)
        result.update(decode_step_ms=round(step * 1e3, 3),
                      decode_floor_ms=round(decode_floor_bytes() / ceiling / 1e6, 3), prefill_s=round(one, 3),
                      ceiling_gbps=round(ceiling))
        result.update(ttft(module, engine(True)))
        print(json.dumps(result), file=sys.stderr, flush=True)
        chats, c = chat_prompts(), CHATS
        chat_tokens = len(chats) * c["new"]
        _timed(engine(True, c["new"], chats, c["budget"]), "warm chats")
        chat_on, (_, chat_stats) = _timed(engine(True, c["new"], chats, c["budget"]), "chats on")
        chat_off, _ = _timed(engine(False, c["new"], chats, c["budget"]), "chats off")
        result.update(chat_on_tokens_per_s=round(chat_tokens / chat_on),
                      chat_off_tokens_per_s=round(chat_tokens / chat_off),
                      chat_reuse=round(chat_stats["reused_prompt_tokens"] / chat_stats["prompt_tokens"], 4),
                      chat_stats=chat_stats)
        print(json.dumps(result), file=sys.stderr, flush=True)
    if extras:
        _timed(hf, "warm generate")
    theirs, _ = _timed(hf, "generate")
    result.update(transformers_tokens_per_s=round(tokens / theirs), on_over_transformers=round(theirs / on, 2))
    return result


def ttft(module, run):
    """Time to first token of each request (mean, p90): the reference's scheduler is
    wrapped to note, at each step, which requests hold a new token (the step before has
    ended: its tokens reached the host)."""
    schedule, first, started = module.Scheduler.schedule, {}, []
    rule, host = module._prefix_len, []

    def timing_rule(*args):  # the host's share of each step spent building L6's inputs and asking it
        t = time.perf_counter()
        out = rule(*args)
        host.append(time.perf_counter() - t)
        return out

    def noting(self):
        now = time.perf_counter()
        for req in self.running + self.waiting:
            if len(req.tokens) > req.prompt_len and req.id not in first:
                first[req.id] = now - started[0]
        return schedule(self)
    module.Scheduler.schedule, module._prefix_len = noting, timing_rule
    try:
        started.append(time.perf_counter())
        total, _ = _timed(run, "ttft run")
    finally:
        module.Scheduler.schedule, module._prefix_len = schedule, rule
    times = sorted(first.values())
    return dict(ttft_mean_s=round(sum(times) / len(times), 3), ttft_p90_s=round(times[int(0.9 * (len(times) - 1))], 3),
                ttft_requests=len(times), rule_ms_per_step=round(1e3 * sum(host) / max(len(host), 1), 3))


def bench_rows(module, start):
    """The grade's row: tokens/s with caching on, beside caching off and transformers' generate."""
    m = measure(module, start=start, extras=False)
    tokens = PARAMS["num_seqs"] * PARAMS["new"]

    def row(rate):
        return dict(us=round(tokens / rate * 1e6, 1), rate=rate)
    return [dict(name="1B llama, 64 x (2048 shared + 64) + 128", params=PARAMS, bytes=decode_floor_bytes(), flops=0,
                 unit="tokens/s", tier="", ours=row(m["on_tokens_per_s"]),
                 baselines={"caching off": row(m["off_tokens_per_s"]),
                            "transformers generate": row(m["transformers_tokens_per_s"])}, measured=m)]


if __name__ == "__main__":
    from _tree import load_drill
    print(json.dumps(measure(load_drill("solutions", "e2_prefix_cache"))))
    sys.exit(0)
