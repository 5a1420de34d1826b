"""`python bench.py --suite`: every row of the README's results table in one process, and a
worked example that a rule picks (report.py renders both as Markdown)."""
import os
import statistics
import time

import torch

from ..io.checkpoint import load_model
from ..io.cli import UsageError
from .measure import (machine, over_runs, prompt_speedups, repeat_rate, run_interleaved,
                      run_kwargs, speculative, summarize, unreliable)
from .report import shell_quote
from ..extras import make_tree
from .measure import tree_spec
from .tree_choice import METHOD, choose_trees, decode_kwargs, fitting, kind, pick_prompts

# the repository, where prompts/ lives
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the README's results table: (checkpoint: 0 = code, 1 = prose; prompts, "" = held-out; temperature)
SUITE = (
    (0, "", 0.0), (0, "", 0.8), (0, "prompts/code_unseen.jsonl", 0.0),
    (1, "", 0.0), (1, "", 0.8), (1, "prompts/prose_unseen.jsonl", 0.0))
# what makes each checkpoint of --suite
TRAIN = ("python train.py", "python train.py --dataset=shakespeare")
# into each row's command
ROW_FLAGS = ("num_prompts", "prompt_tokens", "max_new_tokens", "top_k", "top_p", "seed", "tree",
             "candidates", "calibration_tokens", "tie_margin", "repeats", "device", "dtype",
             "threads")


def flags(cfg, keys, defaults):
    """--key=value for every key whose value differs from its default."""
    return [f"--{k}={cfg[k]:g}" if isinstance(cfg[k], float)
            else f"--{k}={shell_quote(str(cfg[k]))}" for k in keys if cfg[k] != defaults[k]]


def sample_command(cfg, text, tree, sample_defaults):
    """The sample.py command that decodes `text` as bench did: with --speculative and `tree`,
    or autoregressively (tree None); flags that equal sample.py's defaults are left out."""
    keys = ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "device", "dtype", "threads"]
    if cfg["temperature"] == 0:  # greedy decoding ignores top-k and top-p
        keys = [k for k in keys if k not in ("top_k", "top_p")]
    return " ".join(["python sample.py", *flags(cfg, ("out_dir",), sample_defaults),
                     f"--start={shell_quote(text)}", *flags(cfg, keys, sample_defaults)]
                    + ([f"--speculative --tree={tree}"] if tree else []))


def suite(cfg, defaults, sample_defaults, device, dtype, progress):
    """--suite: every row of SUITE on each checkpoint of its model (--suite_dirs: a model's
    checkpoints joined by '+', e.g. trained with other --seed), in one process (defaults: bench.py's
    config, for the rows' commands; sample_defaults: sample.py's, for the worked example's). Every
    prompt is read and every tree chosen first; then the rows take turns, run by run, so that the
    drift of the machine spreads over all of them. Each (row, checkpoint) measures plain
    decoding, the search's pick (a tree with stream nodes) and the fastest tree of each other
    kind (prompt lookup alone, the streams alone or with a lookup branch), interleaved. Returns
    the JSON document that suite_markdown renders."""
    t0 = time.perf_counter()
    dirs = [d.split("+") for d in cfg["suite_dirs"].split(",")]
    loaded = load_checkpoints(cfg, dirs, device, dtype)
    rows, work = plan_rows(cfg, defaults, dirs, loaded)
    for i, w in enumerate(work):
        progress(f"suite: {i + 1}/{len(work)} ({w['cfg']['out_dir']}, {w['row']['prompts']}, "
                 f"{w['row']['decoding']}): tree search")
        w["tree"], w["others"] = choose_trees(w["model"], w["calibration"], w["cfg"], w["kw"],
                                              lambda *a: None)
    for k in range(cfg["repeats"]):
        progress(f"suite: run {k + 1}/{cfg['repeats']} of every row")
        for w in work:
            w["runs"].append(run_row(w, k))
    for i, w in enumerate(work):
        if w["first"] and cfg["tree"] == "auto":
            progress(f"suite: {i + 1}/{len(work)}: every candidate on the measured prompts")
            w["row"]["pick_check"] = pick_check(w, cfg)
    for row in rows:
        summarize_row(row, [w for w in work if w["row"] is row])
    progress(f"suite: done in {time.perf_counter() - t0:.0f} s")
    first = [w for w in work if w["first"]]
    return dict(machine=machine(device, dtype), repeats=cfg["repeats"],
                max_new_tokens=cfg["max_new_tokens"],
                checkpoints=[dict(checkpoint=d, dataset=ckpt["config"]["dataset"],
                                  corpus=ckpt.get("corpus"))
                             for ds, ls in zip(dirs, loaded) for d, (_, _, ckpt) in zip(ds, ls)],
                rows=rows, worked_example=worked_example(first[0], first[1], first[0]["runs"],
                                                         first[1]["runs"], sample_defaults))


def run_row(w, k):
    """Run k of a (row, checkpoint): the results of plain decoding, the pick and each other
    kind's tree, interleaved on every prompt (sampling with seed + k: `run_kwargs`). A pick of
    plain decoding (the tree none) runs it once for both columns, since timing it twice would
    only measure noise."""
    kw = run_kwargs(w["kw"], k)
    others = [speculative(w["model"], t, kw) for t in w["others"].values()]
    if w["tree"] is None:
        plain, *rest = run_interleaved(w["prompts"], [speculative(w["model"], None, kw), *others])
        return [plain, plain, *rest]
    return run_interleaved(w["prompts"], [speculative(w["model"], t, kw)
                                          for t in (None, w["tree"])] + others)


def summarize_row(row, items):
    """A row over its checkpoints: the pick's figures (the median checkpoint's median run, the
    range over every checkpoint and run), each kind's speedup the same way, plain tokens/s and
    the repeat rate (their median and range over the checkpoints)."""
    per = [over_runs([summarize(*run[:2]) for run in w["runs"]]) for w in items]
    median = sorted(range(len(per)), key=lambda i: per[i]["speedup"])[(len(per) - 1) // 2]
    every = [x for r in per for x in r["speedups"]]
    row.update(per[median], speedups=every, speedup_range=[min(every), max(every)],
               tree=tree_spec(items[median]["tree"]), trees=[tree_spec(w["tree"]) for w in items],
               tree_nodes=len(items[median]["tree"]) if items[median]["tree"] else 0,
               match_rate=min(r["match_rate"] for r in per),
               checkpoints=[w["cfg"]["out_dir"] for w in items],
               seeds=[dict(checkpoint=w["cfg"]["out_dir"], tree=tree_spec(w["tree"]),
                           speedup=r["speedup"], speedup_range=r["speedup_range"],
                           ar_tokens_per_s=r["ar_tokens_per_s"], tau=r["mean_accepted"],
                           repeat_rate=r["repeat_rate"]) for w, r in zip(items, per)],
               repeat_rates=[r["repeat_rate"] for r in per])
    row["kinds"] = {}
    for name in ("prompt lookup", "streams", "streams + lookup"):
        xs = []
        for w in items:
            j = 1 if kind(tree_spec(w["tree"])) == name else (
                2 + list(w["others"]).index(name) if name in w["others"] else None)
            if j is not None:
                xs.append((tree_spec(w["tree"] if j == 1 else w["others"][name]),
                           [summarize(run[0], run[j]) for run in w["runs"]]))
        if xs:
            meds = [statistics.median_low(s["speedup"] for s in ss) for _, ss in xs]
            all_ = [s["speedup"] for _, ss in xs for s in ss]
            row["kinds"][name] = dict(speedup=statistics.median_low(meds),
                                      speedup_range=[min(all_), max(all_)],
                                      trees=[t for t, _ in xs])
    if row["efficiency"] > 1:
        unreliable(f"{row['command']}: efficiency {row['efficiency']:.2f} > 1 (a speculative "
                   "pass cannot cost less than a plain one)")


def pick_check(w, cfg):
    """Does the search's pick carry to the measured prompts? Every candidate with stream nodes
    on them, interleaved with plain decoding, --repeats runs (sampling with seed + run): the
    median run's speedup of the pick there and of the best one, so that the best is not the
    luckiest of many single runs."""
    g = w["model"].config.n_drafts
    specs = [c for c in fitting(cfg, g) if kind(c) in METHOD]
    trees = [make_tree(c, g) for c in specs]
    runs = {c: [] for c in specs}
    for k in range(cfg["repeats"]):
        kw = run_kwargs(w["kw"], k)
        ar, *ss = run_interleaved(w["prompts"], [speculative(w["model"], t, kw)
                                                 for t in (None, *trees)])
        for c, s in zip(specs, ss):
            runs[c].append(summarize(ar, s)["speedup"])
    speedups = {c: statistics.median_low(x) for c, x in runs.items()}
    best = max(speedups, key=speedups.get)
    picked = tree_spec(w["tree"])
    return dict(tree=picked, speedup=speedups.get(picked), best_tree=best,
                best_speedup=speedups[best], speedups=speedups, runs=cfg["repeats"])


def load_checkpoints(cfg, dirs, device, dtype):
    """(model, tokenizer, checkpoint) of each CODE_DIR and PROSE_DIR, each with a drafter; a
    missing one says the command that makes it, and a --tree that does not fit is an error,
    before any work."""
    for ds, make in zip(dirs, TRAIN):
        for d in ds:
            if not os.path.isfile(os.path.join(d, "ckpt.pt")):
                make += "" if (d, make) == ("out", TRAIN[0]) else f" --out_dir={d}"
                raise UsageError(f"--suite needs {os.path.join(d, 'ckpt.pt')}: make it with "
                                 f"`{make}`, or point --suite_dirs=CODE_DIR,PROSE_DIR at other "
                                 "checkpoints")
    loaded = [[load_model(d, device, getattr(torch, dtype), cfg["lean"]) for d in ds]
              for ds in dirs]
    for d, (model, _, _) in ((d, x) for ds, ls in zip(dirs, loaded) for d, x in zip(ds, ls)):
        if model.config.n_drafts == 0:
            raise UsageError(f"{d} has no drafter (n_streams=0): --suite measures models with "
                             "streams")
        if cfg["tree"] != "auto":
            make_tree(cfg["tree"], model.config.n_drafts).bind(model.config, device,
                                                               getattr(torch, dtype))
    return loaded


def plan_rows(cfg, defaults, dirs, loaded):
    """(rows, work) of SUITE: each row's description and bench command (of its first
    checkpoint), and for each of its checkpoints what it decodes: the model, config, prompts,
    calibration prompts and the decoders' arguments."""
    rows, work = [], []
    for m, file, temperature in SUITE:
        row = None
        for j, (d, (model, tok, ckpt)) in enumerate(zip(dirs[m], loaded[m])):
            rcfg = dict(cfg, out_dir=d, prompts=os.path.join(ROOT, file) if file else "",
                        temperature=temperature)
            prompts, calibration = pick_prompts(rcfg, ckpt, tok)
            if row is None:
                command = " ".join(["python bench.py", *flags(rcfg, ("out_dir", "temperature"),
                                                              defaults)]
                                   + [f"--prompts={file}"] * bool(file)
                                   + flags(cfg, ROW_FLAGS, defaults))
                row = dict(checkpoint=d, dataset=ckpt["config"]["dataset"],
                           prompts=file or "held-out", n_prompts=len(prompts),
                           temperature=temperature, command=command,
                           decoding="greedy" if temperature == 0 else f"T = {temperature:g}")
                rows.append(row)
            work.append(dict(row=row, first=j == 0, model=model, tok=tok, cfg=rcfg,
                             prompts=prompts, calibration=calibration,
                             kw=decode_kwargs(rcfg, tok), runs=[]))
    return rows, work


def worked_example(greedy, sampled, greedy_runs, sampled_runs, sample_defaults):
    """Of the first row's prompts (held-out code), the one whose greedy tau is the median (the
    lower middle for an even count, ties to the earlier prompt): representative, not picked by
    hand. Its greedy and sampled continuations, the tau and speedup (median and range over the
    runs) of each on it, and the sample.py commands that reproduce them."""
    assert greedy["prompts"] == sampled["prompts"]
    taus = [stats.mean_accepted for _, stats in greedy_runs[0][1]]
    i = sorted(range(len(taus)), key=lambda j: (taus[j], j))[(len(taus) - 1) // 2]
    text = greedy["tok"].decode(greedy["prompts"][i])
    example = dict(prompt_index=i, n_prompts=len(taus), greedy_taus=taus, prompt=text)
    for name, w, runs in (("greedy", greedy, greedy_runs), ("sampled", sampled, sampled_runs)):
        tokens, stats = runs[0][1][i]
        speedups = [prompt_speedups(*run[:2])[i] for run in runs]
        example[name] = dict(temperature=w["cfg"]["temperature"], tree=tree_spec(w["tree"]),
                             tau=stats.mean_accepted, speedup=statistics.median_low(speedups),
                             speedup_range=[min(speedups), max(speedups)],
                             repeat_rate=repeat_rate([tokens]),
                             continuation=w["tok"].decode(tokens),
                             commands=[sample_command(w["cfg"], text, t, sample_defaults)
                                       for t in (w["tree"], None)])
    return example
