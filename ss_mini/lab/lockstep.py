"""Decoders timed in lockstep, for the tree search (tree_choice.py): every candidate decodes the
same prompt at once, one forward pass each in turn, so that a slow spell of the machine falls
on all of them alike instead of on whichever decoded whole while it lasted (docs/seeds.md, "How
steady is the pick?").

Each decoder runs in a thread of its own and decodes only while it holds a baton, which it hands
to the next decoder at each step; its clock (the seconds of its Stats) counts only the time it
held the baton: its prefill, and each pass with what the loop does around it. Each decoder has
KV cache memory of its own (a model keeps one per cache size: `GPT.kv_memory`), which it
takes up with the baton. The figures rank the decoders: each one runs slower than it would
alone (docs/seeds.md).
"""
import threading
import time

from ..baseline import ar_step, generate_ar
from ..generate import generate_speculative
from ..step import speculative_step


class Lockstep:
    """n decoders of one model taking turns pass by pass; `run` decodes a prompt with all of
    them. Their KV cache memory is kept from one run to the next."""

    def __init__(self, model, n):
        self.model = model
        self.memory = [{} for _ in range(n)]

    def run(self, prompt, trees, kw):
        """Every tree (None: plain decoding) on the prompt (or queue) at once, with the decoders'
        keyword arguments kw: a list of (output, Stats), as each decoder alone returns it."""
        self.turn = [threading.Event() for _ in trees]
        self.live, self.lock = list(range(len(trees))), threading.Lock()
        self.spent, self.held = [0.0] * len(trees), [0.0] * len(trees)
        results, errors = [None] * len(trees), []

        def decode(i, tree):
            self.take(i)
            try:
                if tree is None:
                    results[i] = generate_ar(self.model, prompt, **kw, clock=self.clock(i),
                                             step=self.stepped(i, ar_step))
                else:
                    results[i] = generate_speculative(self.model, prompt, tree=tree, **kw,
                                                      clock=self.clock(i),
                                                      step=self.stepped(i, speculative_step))
            except Exception as e:  # raised again in the caller, once every decoder is done
                errors.append(e)
            self.hand_on(i, leave=True)

        memory = self.model.kv_memory
        threads = [threading.Thread(target=decode, args=(i, t)) for i, t in enumerate(trees)]
        for t in threads:
            t.start()
        self.turn[0].set()
        for t in threads:
            t.join()
        self.model.kv_memory = memory
        if errors:
            raise errors[0]
        return results

    def take(self, i):
        """Decoder i waits for the baton, then decodes with its own cache memory and clock."""
        self.turn[i].wait()
        self.turn[i].clear()
        self.model.kv_memory = self.memory[i]
        self.held[i] = time.perf_counter()

    def hand_on(self, i, leave=False):
        """Decoder i's turn is over (leave: for good): the baton to the next one still decoding."""
        self.spent[i] += time.perf_counter() - self.held[i]
        with self.lock:
            nxt = self.live[(self.live.index(i) + 1) % len(self.live)]
            if leave:
                self.live.remove(i)
            if self.live:
                self.turn[nxt].set()

    def clock(self, i):
        """Decoder i's clock: the seconds it has held the baton (it reads it only then)."""
        return lambda: self.spent[i] + time.perf_counter() - self.held[i]

    def stepped(self, i, step):
        """The step of decoder i, which hands the baton on before each pass and waits for it."""
        def step_in_turn(*args, **kwargs):
            self.hand_on(i)
            self.take(i)
            return step(*args, **kwargs)
        return step_in_turn


def run_lockstep(model, prompts, trees, kw):
    """Every tree (None: plain decoding) on every prompt (or queue), all trees at once on each
    prompt in turn: one list of (output, Stats) per tree, as `measure.run_interleaved` returns."""
    lockstep = Lockstep(model, len(trees))
    per_prompt = [lockstep.run(p, trees, kw) for p in prompts]
    return [list(results) for results in zip(*per_prompt)]
