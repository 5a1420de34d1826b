"""How well does the tree search's timing predict the measured prompts? (docs/seeds.md, "How
steady is the pick?")

    python docs/experiments/search_timing.py out 0.8                 # checkpoint, temperature
    python docs/experiments/search_timing.py out-shakespeare 0 prompts/prose_unseen.jsonl

Three measurements of every candidate tree with stream nodes, on one checkpoint and the prompts
`python bench.py` takes for it:
- the search as bench runs it (`tree_search`: every candidate decodes each calibration prompt
  at once, one pass each in turn, ss_mini/lab/lockstep.py), twice (sampling: the second turn
  draws with seed + 1);
- the same calibration prompts decoded *whole, in turn*: each candidate decodes a prompt from
  start to end before the next one starts (`run_interleaved`, as the measurement runs them), a
  candidate's speedup the median over the prompts of its speedup on each; twice, the same way;
- the truth: every candidate on the measured prompts, interleaved with plain decoding as
  `bench.py --suite`'s pick check runs them, three runs (sampling: seed + run); the median.
Then the pick of `tree_choice.pick` on each search turn, and its truth as a share of the best.
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench  # noqa: E402  (bench's config: the candidates, the prompts)
from ss_mini.extras import make_tree
from ss_mini.io.checkpoint import load_model
from ss_mini.lab.measure import (machine, prompt_speedups, run_interleaved, run_kwargs,
                                 speculative, summarize)
from ss_mini.lab.tree_choice import (METHOD, decode_kwargs, fitting, kind, pick, pick_prompts,
                                     tree_search)


def whole_decodes(model, calibration, specs, trees, kw, tie_margin):
    """The search's rows (spec, nodes, summary) with each candidate decoding each calibration
    prompt whole, in turn after plain decoding, and its pick (warmed up on the first prompt)."""
    decoders = lambda kw: [speculative(model, t, kw) for t in (None, *trees)]
    run_interleaved(calibration[:1], decoders({**kw, "max_new_tokens": 32}))
    ar, *ss = run_interleaved(calibration, decoders(kw))
    rows = []
    for spec, tree, s in zip(specs, trees, ss):
        speedup = statistics.median(prompt_speedups(ar, s))  # one prompt at a time: busy = whole
        rows.append((spec, len(tree), dict(speedup=speedup, busy_speedup=speedup,
                                           mean_accepted=summarize(ar, s)["mean_accepted"])))
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

    searched, whole = [], []
    for turn in range(2):
        k = run_kwargs(kw, turn)
        best, rows = tree_search(model, calibration, cfg, k, lambda *a: None)
        searched.append((best, {spec: r["speedup"] for spec, _, r in rows}))
        k = {**k, "max_new_tokens": min(k["max_new_tokens"], cfg["calibration_tokens"])}
        best, rows = whole_decodes(model, calibration, specs, trees, k, cfg["tie_margin"])
        whole.append((best, {spec: r["speedup"] for spec, _, r in rows}))

    truth = {spec: [] for spec in specs}
    for run in range(3):
        k = run_kwargs(kw, run)
        ar, *ss = run_interleaved(prompts, [speculative(model, t, k) for t in (None, *trees)])
        for spec, s in zip(specs, ss):
            truth[spec].append(summarize(ar, s)["speedup"])
    median = {spec: statistics.median(x) for spec, x in truth.items()}
    top = max(median.values())

    print(f"{'tree':>9} {'measured: median (range)':>26} {'search, turn 1 / 2':>20} "
          f"{'whole decodes, turn 1 / 2':>27}")
    for spec in specs:
        print(f"{spec:>9} {median[spec]:12.3f}x ({min(truth[spec]):.3f}-{max(truth[spec]):.3f})"
              f" {searched[0][1][spec]:9.3f} / {searched[1][1][spec]:.3f}"
              f" {whole[0][1][spec]:16.3f} / {whole[1][1][spec]:.3f}")
    for name, turns in (("search", searched), ("whole decodes", whole)):
        print(f"{name} picks: " + ", ".join(f"{b} ({median[b] / top:.0%} of the best, "
                                           f"{max(median, key=median.get)})" for b, _ in turns))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (FileNotFoundError, RuntimeError, ValueError) as e:  # as bench.py reports them
        sys.exit(f"error: {e}")
