"""Which tree bench measures: the prompts, with calibration prompts kept apart from the
reported ones, and the tree search.

How fast a tree decodes depends on the model, the text and the machine: a deeper tree
accepts more tokens per pass, and each pass costs more. So bench times every candidate tree
against the autoregressive baseline on calibration prompts, and measures the pick on other
prompts. Its rules (the median over the prompts, the tie margin) are in `tree_search`; the
search at every batch size: docs/batches.md ("The sweep").
"""
import json
import statistics

import numpy as np

from . import plot
from ..io.checkpoint import training_data
from ..io.cli import UsageError
from ..io.data import load_split
from .lockstep import run_lockstep
from .measure import prompt_speedups, run_pair, summarize, unreliable
from ..extras import make_tree
from ..extras.lookup import LookupTree


def validation_prompts(ckpt, tok, n, length):
    """n snippets of the checkpoint's held-out validation split, each starting at a line start."""
    folder, _ = training_data(ckpt)
    val = load_split(folder, "val")
    newline = tok.encode("\n")[0] if tok.kind == "char" else None
    prompts = []
    for start in np.linspace(0, len(val) - length - 1, n + 1, dtype=np.int64)[:n]:
        if newline is not None:  # begin after a newline: a prompt is whole lines of code or verse
            nl = np.flatnonzero(val[start:start + length] == newline)
            start += int(nl[0]) + 1 if len(nl) else 0
        prompts.append([int(t) for t in val[start:start + length]])
    return prompts


def file_prompts(path, tok):
    """The prompts of a JSON-lines file of {"prompt": "..."}, encoded."""
    out = []
    for i, line in enumerate(open(path, encoding="utf-8"), 1):
        if line.strip():
            try:
                out.append(tok.encode(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UsageError(f'{path}:{i} is not a JSON object with a "prompt" '
                                 'string') from None
    if not out:
        raise UsageError(f"{path} holds no prompts")
    return out


def pick_prompts(cfg, ckpt, tok):
    """(prompts, calibration prompts), disjoint, so that the reported prompts are not the ones
    the tree search tuned on: held-out validation snippets, 2 num_prompts // 3 of them (at
    least 2) spread evenly among the rest to calibrate (8 of the default 20: a pick from fewer
    prompts did not carry to the measured ones), or from --prompts the first num_prompts // 3
    calibrate and the rest are reported (a file with no more prompts than that calibrates on the
    prompts it reports; bench then says so)."""
    n_cal = max(2, cfg["num_prompts"] // 3)
    if cfg["prompts"]:
        prompts = file_prompts(cfg["prompts"], tok)
        if len(prompts) <= n_cal:
            return prompts[:cfg["num_prompts"]], prompts
        return prompts[n_cal:][:cfg["num_prompts"]], prompts[:n_cal]
    n_cal = max(2, 2 * cfg["num_prompts"] // 3)
    both = validation_prompts(ckpt, tok, cfg["num_prompts"] + n_cal, cfg["prompt_tokens"])
    cal = [len(both) * (k + 1) // n_cal - 1 for k in range(n_cal)]  # the last of each n_cal-th
    return [p for i, p in enumerate(both) if i not in cal], [both[i] for i in cal]


def decode_kwargs(cfg, tok):
    """The decoders' keyword arguments from bench's config."""
    return dict(max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"],
                top_k=cfg["top_k"] or None, top_p=cfg["top_p"], seed=cfg["seed"], eot=tok.eot,
                batch_size=cfg["batch_size"])


def kind(spec):
    """What drafts a tree: 'streams', 'streams + lookup' (a lookup branch beside them), 'prompt
    lookup' (the text alone: a baseline, not the method) or 'plain' (none)."""
    if spec == "none":
        return "plain"
    return "prompt lookup" if spec.startswith("L") else ("streams + lookup" if "+L" in spec
                                                        else "streams")


METHOD = ("streams", "streams + lookup")  # the kinds whose figure is Speculative Streaming's


def tree_search(model, calibration, cfg, kw, log):
    """The speedup of every candidate tree that fits the model over one AR baseline, on the
    calibration prompts (or queues) with calibration_tokens new tokens each (at most
    max_new_tokens): the median over the prompts of each prompt's speedup over its whole
    decode (`prompt_speedups`: at B > 1 a queue's drain counts, so the search errs toward
    plain decoding); logs the table and returns the spec of the tree to measure: among the
    trees within tie_margin of the fastest, those within tie_margin of the best of them while
    all of a queue's rows decode (what tokens/s reports; a prompt alone: the same), and of
    those the one with the fewest nodes, then the highest tau (a near-tie is the machine's
    noise, and the smaller tree is the one that two runs agree on). Every decoder is warmed
    up on the first prompt; then all decode each prompt at once, one pass each in turn
    (lockstep.py), so that a slow spell of this machine falls on every candidate alike instead
    of deciding one row. The pick is among the trees with stream nodes (`METHOD`): the method's
    figure, whatever plain decoding or prompt lookup alone would give. Returns (that spec, the
    rows (spec, nodes, summary))."""
    g = model.config.n_drafts
    candidates = fitting(cfg, g)
    kw = {**kw, "max_new_tokens": min(kw["max_new_tokens"], cfg["calibration_tokens"])}
    trees = [make_tree(spec, g) for spec in candidates]
    warm = {**kw, "max_new_tokens": min(kw["max_new_tokens"], 32)}
    run_lockstep(model, calibration[:1], [None, *trees], warm)  # warm-up
    ar, *ss = run_lockstep(model, calibration, [None, *trees], kw)
    # a candidate's speedup: the median over the calibration prompts of its speedup on each,
    # so that a slow spell of the machine during one decode does not decide the pick
    rows = [(spec, len(t) if t else 0,
             dict(summarize(ar, s), speedup=statistics.median(prompt_speedups(ar, s)),
                  busy_speedup=statistics.median(prompt_speedups(ar, s, busy=True))))
            for spec, t, s in zip(candidates, trees, ss)]

    fastest = max(rows, key=lambda row: row[2]["speedup"])
    # the search's own noise: how far plain decoding lands from itself on these prompts (the
    # median over them, as a tree's speedup is)
    plain = [s for spec, s in zip(candidates, ss) if spec == "none"]
    noise = statistics.median(abs(x - 1) for x in prompt_speedups(ar, plain[0])) if plain else 0.0
    best = pick([row for row in rows if kind(row[0]) in METHOD] or rows, noise, cfg["tie_margin"])
    need = 1 + max(cfg["tie_margin"], noise)
    log_search(rows, fastest, best, calibration, cfg, kw, log)
    if plain:
        log(f"plain decoding against itself: {noise:.0%} apart (the median over these prompts), "
            f"so a tree is chosen only at {need:.2f}x or more")
    ar_ms = [s.seconds / s.passes for _, s in ar]
    if max(ar_ms) > 2 * min(ar_ms):
        unreliable(f"an autoregressive pass took {1e3 * min(ar_ms):.2f} to "
                   f"{1e3 * max(ar_ms):.2f} ms across the calibration prompts of the tree search")
    return best[0], rows


def fitting(cfg, g):
    """The candidate trees (specs) of cfg as deep as a model that drafts g tokens ahead."""
    return [c for c in cfg["candidates"].split(";")
            if c and (c.startswith("n") or len(c.split("+")[0].split(",")) <= g)]


def pick(rows, noise, tie_margin):
    """The row (spec, nodes, summary) to measure: a tree must gain more than the search's noise
    (and the tie margin) over plain decoding while all rows decode (what tokens/s reports; at
    B = 1 its whole decode: a queue's drain costs a speculative batch more); among the trees
    within tie_margin of the fastest, those within tie_margin of the busiest of them; of those
    the fewest nodes, then the highest tau. Without plain decoding among the candidates and no
    tree clearing the noise, every tree stays in."""
    need = 1 + max(tie_margin, noise)
    clear = [row for row in rows if row[1] == 0 or row[2]["busy_speedup"] >= need] or rows

    def within(rows, key):  # the rows within tie_margin of the best of them by this measure
        top = max(r[key] for _, _, r in rows)
        return [row for row in rows if row[2][key] >= (1 - tie_margin) * top]
    return min(within(within(clear, "speedup"), "busy_speedup"),
               key=lambda row: (row[1], -row[2]["mean_accepted"]))


def log_search(rows, fastest, best, calibration, cfg, kw, log):
    """The tree search's table, the fastest and the chosen tree marked."""
    log(f"tree search on {n_prompts(calibration)} calibration prompts, {kw['max_new_tokens']} new "
        "tokens each, every candidate and one autoregressive baseline decoding each prompt at "
        "once, a pass each in turn (so each runs slower than alone: the figures rank the trees); "
        f"the baseline at {rows[0][2]['ar_tokens_per_s']:.0f} tokens/s:")
    log(f"{'tree':>8} {'nodes':>5} {'SS tok/s':>9} {'speedup':>8} {'busy':>6} {'tau':>5} {'CR':>5} "
        f"{'SS ms/pass':>10}  (speedup: the median over the prompts, each over its whole decode; "
        "busy: while all rows decode)")
    for row in rows:
        spec, n, r = row
        mark = ("  <- fastest" if row is fastest else "") + ("  <- chosen" if row is best else "")
        if row is best and row is not fastest:
            mark += (f" (within {cfg['tie_margin']:.0%} of the fastest and of the busiest of "
                     "those, the fewest nodes)")
        log(f"{spec:>8} {n:>5} {r['ss_tokens_per_s']:9.0f} {r['speedup']:7.2f}x "
            f"{r['busy_speedup']:5.2f}x {r['mean_accepted']:5.2f} {r['call_reduction']:5.2f} "
            f"{r['ss_ms_per_pass']:10.2f}" + mark)


def choose_tree(model, calibration, cfg, kw, log):
    """The tree to measure: --tree, or the tree search's pick (--tree=auto); then this very
    tree object, whose shapes are built on first use, warms up on the calibration prompts."""
    return choose_trees(model, calibration, cfg, kw, log)[0]


def choose_trees(model, calibration, cfg, kw, log):
    """(the tree to measure, {kind: the tree measured beside it}): with the search, the fastest
    tree of each other kind on the calibration prompts (prompt lookup alone, the streams alone,
    the streams with a lookup branch), where candidates of it were tried; with --tree, prompt
    lookup alone (`lookup_baseline`). Each tree warms up on the calibration prompts."""
    spec, rows = cfg["tree"], []
    if spec == "auto" or cfg.get("sweep"):
        best, rows = tree_search(model, calibration, cfg, kw, log)
        if cfg["plot"]:
            tokens = min(kw["max_new_tokens"], cfg["calibration_tokens"])
            title = (f"tree search of {cfg['out_dir']} on {n_prompts(calibration)} calibration "
                     f"prompts x {tokens} new tokens (shorter than the measurement's, so other "
                     "speedups)")
            plot.tree_search(rows, best, cfg["plot"], title, cfg["tie_margin"],
                             model.config.n_drafts)
            log(f"tree search plotted in {cfg['plot']}")
        spec = best if spec == "auto" else spec
    g, warm = model.config.n_drafts, {**kw, "max_new_tokens": min(kw["max_new_tokens"],
                                                                    cfg["calibration_tokens"])}
    tree = make_tree(spec, g)
    others = {}
    for k in ("prompt lookup", *METHOD):
        of_kind = [row for row in rows if kind(row[0]) == k and row[0] != spec]
        if of_kind and (k != kind(spec) or k == "prompt lookup"):
            others[k] = make_tree(max(of_kind, key=lambda row: row[2]["speedup"])[0], g)
    if "prompt lookup" not in others and lookup_baseline(tree) is not None:
        others["prompt lookup"] = lookup_baseline(tree)
    for t in [tree, *others.values()]:
        run_pair(model, calibration, t, warm)
    return tree, others


def lookup_baseline(tree):
    """Prompt-lookup decoding with the same model, cache and step, to compare a tree with: L
    and the tree's lookup length (L4 for a tree without one); None for a lookup-only tree."""
    if tree is None or (tree.lookup_length and not tree.ks):
        return None
    return LookupTree((), tree.lookup_length or 4)


def batched(prompts, batch_size, waves=2, queues=2):
    """The prompts as a server meets them at batch_size rows: `queues` queues (so that
    interleaved decoders take turns), each of at least `waves` waves of batch_size prompts, drawn in
    turn from the prompt set, each prompt keeping a different number of its last tokens (half to
    all) so that a batch mixes lengths. A queue decodes with batch_size rows at once, the next
    prompt taking the row of one that finishes (continuous batching), so a row that drafts
    badly holds up no other. batch_size 1: the prompts as they are, one by one."""
    if batch_size == 1:
        return prompts
    n = max(len(prompts), waves * queues * batch_size)
    rows = [prompts[i % len(prompts)][(i * 7) % (len(prompts[i % len(prompts)]) // 2 + 1):]
            for i in range(n)]
    size = -(-n // queues)
    return [rows[i:i + size] for i in range(0, n, size)]


def calibration_batches(calibration, batch_size):
    """The calibration prompts at batch_size rows for the tree search: one queue per prompt,
    each a single wave of batch_size rows, so the candidates take turns as many times as on
    the prompts one by one at B = 1; with one queue, a burst of load on the machine during
    one candidate's turn decides the pick."""
    return batched(calibration, batch_size, waves=1, queues=len(calibration))


def n_prompts(items):
    """How many prompts a list of prompts or of queues (`batched`) holds."""
    return sum(len(q) for q in items) if items and isinstance(items[0][0], list) else len(items)
