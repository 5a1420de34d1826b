"""`python bench.py --batch_sweep`: plain and speculative decoding at batch sizes 1, 2, 4, ...,
with a tree search at each size, and the batch size where speculation stops paying
(docs/batches.md)."""
import torch

from . import plot
from ..io.checkpoint import load_model
from ..io.cli import UsageError
from ..baseline import generate_ar
from .measure import (machine, over_runs, run_interleaved, run_kwargs, speculative, summarize,
                      threads, tree_spec)
from .tree_choice import (batched, calibration_batches, choose_tree, decode_kwargs, n_prompts,
                          pick_prompts)

SWEEP = (1, 2, 4, 8, 16, 32)


def next_candidates(candidates, slowest, margin):
    """The candidates of the next batch size: all of them while speculation paid in every run
    at this size (its slowest run more than `margin` faster than plain decoding); otherwise
    only `none`. A bigger batch has less spare compute for a tree's extra rows, so a gain
    within the noise here is a loss at the next size (vLLM turns speculation off above a
    batch size likewise); searching trees there only gives the machine's noise a chance to
    pick one that loses. With the tree `none` the slowest run is 1.0: speculation stays off."""
    return candidates if slowest > 1 + margin else ["none"]


def batch_sweep(cfg, device, dtype, progress, log, mode):
    """--batch_sweep: at each batch size B a tree search (the tree `none` among the candidates,
    so speculation is off where no tree pays), then plain and speculative decoding of the same
    batches, interleaved, --repeats times (the median run, and the range; with `none` both
    columns are plain decoding's runs). Sizes 1..32, and on while plain decoding's throughput
    still grows by 10% a doubling. mode: bench's words for the decoding mode. Returns the JSON
    result."""
    model, tok, ckpt = load_model(cfg["out_dir"], device, getattr(torch, dtype), cfg["lean"])
    if model.config.n_drafts == 0:
        raise UsageError(f"{cfg['out_dir']} has no drafter (n_streams=0): train one with "
                         "--n_streams=3")
    prompts, calibration = pick_prompts(cfg, ckpt, tok)
    kw = decode_kwargs(cfg, tok)
    rows = sweep(model, prompts, calibration, cfg, kw, progress)
    log(f"model {cfg['out_dir']}, {mode}, {kw['max_new_tokens']} new tokens per prompt, "
        f"{device} {dtype}, {threads()}; at each batch size B a tree search "
        f"({cfg['batch_candidates']}), then plain and speculative decoding of the same queues of "
        f"prompts, B rows at once (a row that finishes takes the next prompt), interleaved; the "
        f"median of {cfg['repeats']} runs:")
    stop = log_rows(rows, cfg, log)
    if cfg["plot"]:
        plot.batch_sweep(rows, cfg["plot"],
                         f"{cfg['out_dir']}: plain and speculative decoding against batch size")
        log(f"batch sweep plotted in {cfg['plot']}")
    return {"batch_sweep": rows, "stops_paying_at": stop, "machine": machine(device, dtype)}


def sweep(model, prompts, calibration, cfg, kw, progress):
    """One row per batch size: its tree search's pick and the --repeats runs' summary."""
    search = {**cfg, "tree": "auto", "plot": ""}
    rows, B, candidates = [], 1, cfg["batch_candidates"].split(";")
    while B <= cfg["max_batch_size"] and (
            B in SWEEP or rows[-1]["ar_tokens_per_s"] > 1.1 * rows[-2]["ar_tokens_per_s"]):
        progress(f"bench: batch size {B}")
        batches, kw = batched(prompts, B), {**kw, "batch_size": B}
        tree = None if candidates == ["none"] else choose_tree(
            model, calibration_batches(calibration, B),
            {**search, "candidates": ";".join(candidates)}, kw, lambda *a: None)
        decoders = lambda kw: ([lambda p: generate_ar(model, p, **kw)]
                               + ([speculative(model, tree, kw)] if tree else []))
        runs = [run_interleaved(batches, decoders(run_kwargs(kw, i)))  # sampling: seed + i
                for i in range(cfg["repeats"])]
        # the tree none: speculative decoding is plain decoding, the same runs (timing it twice
        # measures noise)
        r = over_runs([summarize(results[0], results[-1]) for results in runs])
        rows.append(dict(r, batch_size=B, tree=tree_spec(tree), rows=n_prompts(batches)))
        candidates = next_candidates(candidates, r["speedup_range"][0], cfg["tie_margin"])
        B *= 2
    return rows


def log_rows(rows, cfg, log):
    """The sweep's table and where speculation stops paying; returns that batch size (None
    where a tree paid at every size)."""
    log(f"{'batch':>5} {'prompts':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} "
        f"{'range':>11} {'drained':>8} {'tau':>5} {'tree':>8} {'identical':>9} "
        f"{'latency plain':>13} {'latency spec':>12}")
    for r in rows:
        low, high = r["speedup_range"]
        log(f"{r['batch_size']:>5} {r['rows']:>7} {r['ar_tokens_per_s']:11.0f} "
            f"{r['ss_tokens_per_s']:10.0f} {r['speedup']:7.2f}x {low:5.2f}-{high:.2f} "
            f"{r['drained_speedup']:7.2f}x {r['mean_accepted']:5.2f} {r['tree']:>8} "
            f"{r['match_rate']:9.0%} {r['ar_latency_s']:12.2f}s {r['ss_latency_s']:11.2f}s")
    i = next((i for i, r in enumerate(rows) if r["tree"] == "none"), None)
    margin = f"{cfg['tie_margin']:.0%}"
    if i is None:
        log(f"speculation stops paying at batch size above {rows[-1]['batch_size']} (a tree still "
            "paid at every size)")
    else:  # the search chose none there, or the size below paid within the margin in some run
        below = rows[i - 1]
        narrow = (i and below["tree"] != "none"
                  and below["speedup_range"][0] <= 1 + cfg["tie_margin"])
        why = (f"at batch size {below['batch_size']} the slowest run beat plain decoding by no "
               f"more than {margin}" if narrow
               else f"no tree beat plain decoding by more than {margin} there")
        log(f"speculation stops paying at batch size {rows[i]['batch_size']} and is off from there "
            f"on: {why}")
    log("tokens/s: while all B rows decode (measure.py); drained: the speedup over each queue's "
        "whole decode, the last rows finishing one by one included; latency: the mean time until "
        "a prompt's output is complete; identical: greedy outputs equal to plain decoding's, per "
        "prompt; tree none: speculation off, plain decoding's runs in both columns")
    return None if i is None else rows[i]["batch_size"]
