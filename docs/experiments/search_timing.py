"""How well does the tree search's timing predict the measured prompts? (docs/seeds.md, "How
steady is the pick?")

    python docs/experiments/search_timing.py out 0.8                 # checkpoint, temperature
    python docs/experiments/search_timing.py out-shakespeare 0 prompts/prose_unseen.jsonl

Three measurements of every candidate tree with stream nodes, on one checkpoint and the prompts
`python bench.py` takes for it:
- the search as bench runs it (`tree_search`: each candidate decodes each calibration prompt
  whole, in turn), twice (sampling: the second turn draws with seed + 1);
- the same calibration prompts in *lockstep*: every candidate decodes the prompt at once, one
  pass each in turn (each decoder in its own thread, a baton passed at every step), so that a
  slow spell of the machine falls on all candidates alike; a candidate's speedup is its tokens
  per pass over plain decoding's times plain decoding's mean time per pass over its own
  (prefill left out); twice, the same way;
- the truth: every candidate on the measured prompts, interleaved with plain decoding as
  `bench.py --suite`'s pick check runs them, three runs (sampling: seed + run); the median.
Then the pick of `tree_choice.pick` on each search turn, and its truth as a share of the best.
"""
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench  # noqa: E402  (bench's config: the candidates, the prompts)
from ss_mini.baseline import ar_step, generate_ar
from ss_mini.extras import make_tree
from ss_mini.generate import generate_speculative
from ss_mini.io.checkpoint import load_model
from ss_mini.lab.measure import machine, run_interleaved, run_kwargs, speculative, summarize
from ss_mini.lab.tree_choice import (METHOD, decode_kwargs, fitting, kind, pick, pick_prompts,
                                     tree_search)
from ss_mini.step import speculative_step


class Lockstep:
    """Decoders that take turns pass by pass: decoder i runs only while it holds the baton, which
    it hands to the next live decoder at each step; its pass times are the time it held the
    baton (one whole loop iteration: the step, emit, lookup). Each decoder gets its own KV cache
    memory (the model keeps one per cache size: `GPT.kv_memory`), set when it takes its turn."""

    def __init__(self, model, n):
        self.model, self.turn = model, [threading.Event() for _ in range(n)]
        self.live, self.lock = list(range(n)), threading.Lock()
        self.memory, self.times = [{} for _ in range(n)], [[] for _ in range(n)]
        self.held = [None] * n  # when decoder i took the baton last

    def hand_on(self, i, leave=False):
        with self.lock:
            nxt = self.live[(self.live.index(i) + 1) % len(self.live)]
            if leave:
                self.live.remove(i)
            if self.live:
                self.turn[nxt].set()

    def take(self, i):
        self.turn[i].wait()
        self.turn[i].clear()
        self.model.kv_memory = self.memory[i]
        self.held[i] = time.perf_counter()

    def give(self, i, leave=False):
        """Decoder i's pass is over: its time, and the baton to the next."""
        self.times[i].append(time.perf_counter() - self.held[i])
        self.hand_on(i, leave)

    def step(self, i, step):
        first = [True]

        def stepped(*args, **kwargs):
            if first[0]:  # the prefill before it is not a decode pass
                first[0] = False
                self.hand_on(i)
            else:
                self.give(i)
            self.take(i)
            return step(*args, **kwargs)
        return stepped

    def run(self, prompt, trees, kw):
        """Every tree (None: plain decoding) on the prompt at once: [(Stats, pass times)]."""
        stats = [None] * len(trees)

        def decode(i, tree):
            self.take(i)
            with torch.inference_mode():
                if tree is None:
                    stats[i] = generate_ar(self.model, prompt, **kw, step=self.step(i, ar_step))[1]
                else:
                    stats[i] = generate_speculative(self.model, prompt, tree=tree, **kw,
                                                    step=self.step(i, speculative_step))[1]
            self.give(i, leave=True)
        threads = [threading.Thread(target=decode, args=(i, t)) for i, t in enumerate(trees)]
        for t in threads:
            t.start()
        self.turn[0].set()
        for t in threads:
            t.join()
        return list(zip(stats, self.times))


def lockstep_search(model, calibration, specs, trees, kw, tie_margin):
    """The search's rows (spec, nodes, summary) from lockstep decoding, and its pick."""
    memory = model.kv_memory
    per = [Lockstep(model, len(trees) + 1).run(p, [None, *trees], kw) for p in calibration]
    model.kv_memory = memory
    rate = lambda st, ts: (st.new_tokens - 1) / sum(ts)  # the prefill's first token left out
    rows = []
    for j, (spec, tree) in enumerate(zip(specs, trees), 1):
        speedup = statistics.median(rate(*p[j]) / rate(*p[0]) for p in per)
        tau = statistics.mean(a for p in per for a in p[j][0].accepted)
        rows.append((spec, len(tree), dict(speedup=speedup, busy_speedup=speedup,
                                          mean_accepted=tau)))
    return pick(rows, 0.0, tie_margin)[0], rows


def main(args):
    usage = "give CHECKPOINT_DIR TEMPERATURE [PROMPTS.jsonl], e.g. `out 0.8`"
    if len(args) not in (2, 3) or not args[1].replace(".", "", 1).isdigit():
        raise ValueError(usage)
    out_dir, temperature, prompts_file = args[0], float(args[1]), (args[2:] or [""])[0]
    cfg = dict(bench.config, out_dir=out_dir, temperature=temperature, prompts=prompts_file)
    model, tok, ckpt = load_model(out_dir, lean=True)
    prompts, calibration = pick_prompts(cfg, ckpt, tok)
    kw, g = decode_kwargs(cfg, tok), model.config.n_drafts
    specs = [c for c in fitting(cfg, g) if kind(c) in METHOD]
    trees = [make_tree(c, g) for c in specs]
    m = machine("cpu", "float32")
    print(f"{out_dir}, T={temperature:g}, {prompts_file or 'held-out prompts'}; {m['processor']}, "
          f"{m['threads']} threads, torch {m['torch']}")

    searched, locked = [], []
    for turn in range(2):
        k = run_kwargs(kw, turn)
        best, rows = tree_search(model, calibration, cfg, k, lambda *a: None)
        searched.append((best, {spec: r["speedup"] for spec, _, r in rows}))
        lockstep_search(model, calibration[:1], specs, trees,
                        {**k, "max_new_tokens": 32}, cfg["tie_margin"])  # warm-up
        best, rows = lockstep_search(model, calibration, specs, trees, k, cfg["tie_margin"])
        locked.append((best, {spec: r["speedup"] for spec, _, r in rows}))

    truth = {spec: [] for spec in specs}
    for run in range(3):
        k = run_kwargs(kw, run)
        ar, *ss = run_interleaved(prompts, [speculative(model, t, k) for t in (None, *trees)])
        for spec, s in zip(specs, ss):
            truth[spec].append(summarize(ar, s)["speedup"])
    median = {spec: statistics.median(x) for spec, x in truth.items()}
    top = max(median.values())

    print(f"{'tree':>9} {'measured: median (range)':>26} {'search, turn 1 / 2':>20} "
          f"{'lockstep, turn 1 / 2':>22}")
    for spec in specs:
        print(f"{spec:>9} {median[spec]:12.3f}x ({min(truth[spec]):.3f}-{max(truth[spec]):.3f})"
              f" {searched[0][1][spec]:9.3f} / {searched[1][1][spec]:.3f}"
              f" {locked[0][1][spec]:11.3f} / {locked[1][1][spec]:.3f}")
    for name, turns in (("search", searched), ("lockstep", locked)):
        print(f"{name} picks: " + ", ".join(f"{b} ({median[b] / top:.0%} of the best, "
                                           f"{max(median, key=median.get)})" for b, _ in turns))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (FileNotFoundError, RuntimeError, ValueError) as e:  # as bench.py reports them
        sys.exit(f"error: {e}")
