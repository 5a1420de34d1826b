"""`python bench.py --suite`: every row of the README's results table in one process, and a
worked example that a rule picks (report.py renders both as Markdown)."""
import os
import statistics
import time

import torch

from ..io.checkpoint import load_model
from ..io.cli import UsageError
from .measure import (machine, over_runs, prompt_speedups, repeat_rate, run_interleaved,
                      run_kwargs, run_pair, speculative, summarize, unreliable)
from .report import shell_quote
from ..extras import make_tree
from .measure import tree_spec
from .tree_choice import choose_tree, decode_kwargs, pick_prompts

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
    """--suite: every row of SUITE in one process (defaults: bench.py's config, for the rows'
    commands; sample_defaults: sample.py's, for the worked example's). Every prompt is read and
    every tree chosen first; then the rows take turns, run by run, so that the drift of the
    machine spreads over all of them. Returns the JSON document that suite_markdown renders."""
    t0 = time.perf_counter()
    dirs = cfg["suite_dirs"].split(",")
    loaded = load_checkpoints(cfg, dirs, device, dtype)
    rows, work = plan_rows(cfg, defaults, dirs, loaded)
    for i, (row, w) in enumerate(zip(rows, work)):
        progress(f"suite: row {i + 1}/{len(rows)} ({row['checkpoint']}, {row['prompts']}, "
                 f"{row['decoding']}): tree search")
        w["tree"] = choose_tree(w["model"], w["calibration"], w["cfg"], w["kw"], lambda *a: None)
    runs = [[] for _ in rows]
    for k in range(cfg["repeats"]):
        progress(f"suite: run {k + 1}/{cfg['repeats']} of every row")
        for w, row_runs in zip(work, runs):
            row_runs.append(run_row(w, k))
    for row, w, row_runs in zip(rows, work, runs):
        row.update(over_runs([summarize(*run) for run in row_runs]), tree=tree_spec(w["tree"]),
                   tree_nodes=len(w["tree"]) if w["tree"] else 0)
        if row["efficiency"] > 1:
            unreliable(f"{row['command']}: efficiency {row['efficiency']:.2f} > 1 (a speculative "
                       "pass cannot cost less than a plain one)")
    progress(f"suite: done in {time.perf_counter() - t0:.0f} s")
    return dict(machine=machine(device, dtype), repeats=cfg["repeats"],
                max_new_tokens=cfg["max_new_tokens"],
                checkpoints=[dict(checkpoint=d, dataset=ckpt["config"]["dataset"],
                                  corpus=ckpt.get("corpus"))
                             for d, (_, _, ckpt) in zip(dirs, loaded)],
                rows=rows, worked_example=worked_example(work[0], work[1], runs[0], runs[1],
                                                         sample_defaults))


def run_row(w, k):
    """Run k of a row: (plain, speculative) results, interleaved on every prompt (sampling with
    seed + k: `run_kwargs`). A row whose search picked plain decoding (the tree none) runs it
    once for both columns, since timing it twice would only measure noise."""
    kw = run_kwargs(w["kw"], k)
    if w["tree"] is None:
        plain = run_interleaved(w["prompts"], [speculative(w["model"], None, kw)])[0]
        return [plain, plain]
    return run_pair(w["model"], w["prompts"], w["tree"], kw)


def load_checkpoints(cfg, dirs, device, dtype):
    """(model, tokenizer, checkpoint) of CODE_DIR and PROSE_DIR, both with a drafter; a missing
    one says the command that makes it, and a --tree that does not fit is an error, before any
    work."""
    for d, make in zip(dirs, TRAIN):
        if not os.path.isfile(os.path.join(d, "ckpt.pt")):
            make += "" if (d, make) == ("out", TRAIN[0]) else f" --out_dir={d}"
            raise UsageError(f"--suite needs {os.path.join(d, 'ckpt.pt')}: make it with `{make}`, "
                             "or point --suite_dirs=CODE_DIR,PROSE_DIR at other checkpoints")
    loaded = [load_model(d, device, getattr(torch, dtype), cfg["lean"]) for d in dirs]
    for d, (model, _, _) in zip(dirs, loaded):
        if model.config.n_drafts == 0:
            raise UsageError(f"{d} has no drafter (n_streams=0): --suite measures models with "
                             "streams")
        if cfg["tree"] != "auto":
            make_tree(cfg["tree"], model.config.n_drafts).bind(model.config, device,
                                                               getattr(torch, dtype))
    return loaded


def plan_rows(cfg, defaults, dirs, loaded):
    """(rows, work) of SUITE: each row's description and bench command, and what it decodes:
    its model, config, prompts, calibration prompts and the decoders' arguments."""
    rows, work = [], []
    for m, file, temperature in SUITE:
        model, tok, ckpt = loaded[m]
        rcfg = dict(cfg, out_dir=dirs[m], prompts=os.path.join(ROOT, file) if file else "",
                    temperature=temperature)
        prompts, calibration = pick_prompts(rcfg, ckpt, tok)
        command = " ".join(["python bench.py", *flags(rcfg, ("out_dir", "temperature"), defaults)]
                           + [f"--prompts={file}"] * bool(file) + flags(cfg, ROW_FLAGS, defaults))
        rows.append(dict(checkpoint=dirs[m], dataset=ckpt["config"]["dataset"],
                         prompts=file or "held-out", n_prompts=len(prompts),
                         temperature=temperature, command=command,
                         decoding="greedy" if temperature == 0 else f"T = {temperature:g}"))
        work.append(dict(model=model, tok=tok, cfg=rcfg, prompts=prompts, calibration=calibration,
                         kw=decode_kwargs(rcfg, tok)))
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
        speedups = [prompt_speedups(*run)[i] for run in runs]
        example[name] = dict(temperature=w["cfg"]["temperature"], tree=tree_spec(w["tree"]),
                             tau=stats.mean_accepted, speedup=statistics.median_low(speedups),
                             speedup_range=[min(speedups), max(speedups)],
                             repeat_rate=repeat_rate([tokens]),
                             continuation=w["tok"].decode(tokens),
                             commands=[sample_command(w["cfg"], text, t, sample_defaults)
                                       for t in (w["tree"], None)])
    return example
