"""What `make chat` is made of, naming no drill (tests/drills/<id>/bench.py hands in the
engine, its kernels' modules and the model): the kernels handed to an engine running in
the worker, which note each step of it (tests/_progress.py); a line per step printed from
those notes; a line every few seconds while a model loads; the chat template over turns;
a reply's text without special tokens.
"""
import os
import time

from _progress import Every, Watch, note
from _tree import ROOT, load_drill
from _worker import WORKER


class NotingKernels:
    """`kernels=` for an engine in the worker: each name in `stems` is that function of the
    module `stems[name]` of `tree`; each call of a name in `steps` (the attention, called once
    a layer) notes how far the engine is: (steps done, the last one's sequences, tokens in and
    longest context, read from query_start_loc and seq_lens, arguments 5 and 6, at its first
    layer; then the layers done of the step under way, and the layers)."""

    def __init__(self, tree, stems, steps, layers):
        self.tree, self.stems, self.steps, self.layers, self.calls = str(tree), dict(stems), set(steps), layers, 0
        self.done = (0, 0, 0, 0)

    def __getattr__(self, name):
        stems = self.__dict__.get("stems", {})  # unpickling asks before __dict__ is filled
        if name not in stems:
            raise AttributeError(name)
        kernel = getattr(load_drill(self.tree, stems[name]), name)
        if name not in self.steps:
            return kernel

        def noted(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, *args, **kwargs):
            step, layer = divmod(self.calls, self.layers)
            if layer == 0:  # one read of the lengths a step (on a GPU, a wait for it)
                self.shape = (len(seq_lens), int(query_start_loc[-1]), int(seq_lens.max()))
            out = kernel(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, *args, **kwargs)
            self.calls += 1
            if layer + 1 == self.layers:
                self.done = (step + 1, *self.shape)
            note(*self.done, (layer + 1) % self.layers, self.layers)
            return out
        return noted


class StepLines:
    """Prints NotingKernels' notes (polled: a fast engine's steps are seen a few a second): a
    line for the last step done, with the time since the call began and, once steps decode
    (a token for each sequence), how long the rest takes at most at that pace (`tokens` new
    tokens a reply at most, the first made by the prompt's last step); and where `slow`
    seconds passed without a line, the layer the step under way is at."""

    def __init__(self, tokens, slow=10):
        self.tokens, self.slow, self.first_decode, self.said, self.shown = tokens, slow, None, 0.0, 0

    def show(self, found, seconds):
        if len(found) != 6:
            return
        step, seqs, new, context, layer, layers = found
        if step <= self.shown:
            if seconds - self.said >= self.slow:
                self.said = seconds
                print(f"  step {step + 1}: at layer {layer} of {layers} · {seconds:.1f} s", flush=True)
            return
        self.said, self.shown = seconds, step
        line = (f"  step {step}: {seqs} sequence{'s' * (seqs != 1)}, {new} token{'s' * (new != 1)} in, longest "
                f"context {context} · {seconds:.1f} s")
        if new == seqs and self.first_decode is None:
            self.first_decode = (step, seconds)
        elif new == seqs and step > self.first_decode[0]:
            pace = (seconds - self.first_decode[1]) / (step - self.first_decode[0])
            left = max(self.tokens - 2 - (step - self.first_decode[0]), 0)
            line += f" · {pace:.2f} s a decode step: at most {left} more, ~{left * pace:.0f} s"
        print(line, flush=True)


def watching(tokens):
    """The block's engine steps, a line each (the worker's scratch folder is polled)."""
    return Watch(lambda: WORKER.scratch, StepLines(tokens).show)


class Ticker(Every):
    """`with Ticker(text) as t:` prints `text: N s` every `every` seconds while the block
    runs; t.seconds is how long it took."""

    def __init__(self, text, every=10):
        self.text, self.every, self.seconds = text, every, 0.0

    def tick(self):
        print(f"{self.text}: {time.monotonic() - self.started:.0f} s", flush=True)


def shown(path):
    """A path as the learner would type it: relative to the repository when inside it."""
    path = os.path.realpath(path)
    return os.path.relpath(path, ROOT) if path.startswith(str(ROOT) + os.sep) else path


def describe(model, name):
    c = model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return (f"model: {name}, {type(model).__name__}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{heads} query heads over {kv} KV heads (a GQA group of {heads // kv}), head size {head_dim}, "
            f"{str(model.dtype).removeprefix('torch.')}")


def template(tokenizer, messages):
    """User and assistant messages, alternating, under the model's chat template, ready for
    the next reply (a checkpoint without one: the messages' plain text)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer("\n".join(messages)).input_ids
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": m} for i, m in enumerate(messages)]
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=False))


def text_of(tokenizer, reply):
    """A reply's text, without the template's special tokens (the <|im_end|> that ends it),
    cleaned: the engine that chose its tokens is the learner's, and a byte-level vocabulary
    spells ESC as readily as any letter (tests/_render.py's clean_text)."""
    from _render import clean_text
    return clean_text(tokenizer.decode(reply, skip_special_tokens=True))


def token_lists(value, count):
    """Whether `value` (data from the worker) is `count` lists of int token ids."""
    return (isinstance(value, list) and len(value) == count
            and all(isinstance(r, list) and all(type(t) is int for t in r) for r in value))


def reuse_line(stats, prompt_tokens):
    """What a prefix-caching engine's stats (design.md's E2 dict of ints, data from the worker)
    say a call reused, where its last prompt holds `prompt_tokens` (any before it reused
    nothing: they came first)."""
    keys = ("reused_prompt_tokens", "prompt_tokens", "cascade_steps", "steps")
    if not (isinstance(stats, dict) and all(type(stats.get(k)) is int for k in keys)):
        return f"the stats are not design.md's dict of ints: {str(stats)[:200]}"
    reused, before = stats["reused_prompt_tokens"], stats["prompt_tokens"] - prompt_tokens
    return (f"reused {reused} of its {prompt_tokens} prompt tokens ({reused / max(prompt_tokens, 1):.0%}), computed "
            f"{prompt_tokens - reused}" + (f" (and the {before} before it, to cache them)" if before else "")
            + f"; {stats['cascade_steps']} of the call's {stats['steps']} steps through cascade")
