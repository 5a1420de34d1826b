"""Measuring the decoders: interleaved runs, the report's metrics, and the cost of one step.

Metrics (defined here only; bench.py reports them):
- tokens/s: new tokens / wall time, prefill included, summed over the prompts of a run
  (total tokens / total seconds), while the batch runs at full strength: a prompt decoded
  alone, its whole generation; a queue of prompts at B rows, from its start until a row
  finishes with no prompt left to take its place. What follows, the last rows finishing one
  by one, is the drain of a finite queue, which a server with a steady stream of requests
  never reaches; speculation makes it longer (rows accept at different rates), and
  docs/batches.md measures it apart. Latency (below) keeps the whole decode.
- passes: forward passes (of the batch, in the same span), the prefill counted in both decoders.
- tau (mean accepted length): tokens emitted per speculative decode pass: its accepted drafts
  and the token the target adds after them (at least 1).
- call-reduction CR: AR passes / SS passes for the same tokens (SS tokens per pass / AR
  tokens per pass, in the spans above).
- speedup: SS tokens/s / AR tokens/s; efficiency: speedup / CR (what a speculative pass
  costs against a plain one, inverted).
- repeat rate: the share of the autoregressive output's 12-grams that occurred earlier in
  the same output (`repeat_rate`); above one half, most of the speedup is drafting
  repeated text.
- over repeated runs (`over_runs`): the speedup is the median run's and its range is the
  lowest and highest run's; every other figure is the median run's (for an even count,
  the lower of the two middle runs).
Anything compared is run interleaved in one process, so that the drift of the machine
hits all of it alike.
"""
import functools
import os
import platform
import statistics
import sys
import time

import torch

from ..extras.compile import compile_step
from ..baseline import ar_step, ar_window, generate_ar
from ..generate import generate_speculative
from ..sampling import Sampler
from ..step import prefill, speculative_step
from ..extras.budget_tree import BudgetTree


def run_interleaved(prompts, decoders):
    """Every decoder on every prompt, the order rotating from prompt to prompt; returns one
    list of results per decoder."""
    results = [[] for _ in decoders]
    for i, p in enumerate(prompts):
        for j in range(len(decoders)):
            k = (i + j) % len(decoders)
            results[k].append(decoders[k](p))
    return results


def tree_spec(tree):
    """The spec that makes this tree again: `make_tree(tree_spec(t), g)` (None: 'none')."""
    return "none" if tree is None else str(tree)


def run_kwargs(kw, i):
    """The decoders' arguments for measurement run i: sampling draws with seed + i, so that the
    runs' range holds the spread of the draws (tau moves by a few percent from seed to seed), not
    only the machine's; greedy runs are the same decode each time."""
    sampled = kw["temperature"] > 0 and kw["seed"] is not None
    return {**kw, "seed": kw["seed"] + i} if sampled else kw


def run_pair(model, prompts, tree, kw, steps=None):
    """AR and SS on the same prompts, interleaved."""
    return run_interleaved(prompts, [plain(model, kw, steps), speculative(model, tree, kw, steps)])


def compiled_steps():
    """(the autoregressive step, the speculative step), each compiled whole (extras/compile.py)."""
    return compile_step(ar_step), compile_step(speculative_step)


def plain(model, kw, steps=None):
    """Plain decoding, with the steps given (eager: None)."""
    return lambda p: generate_ar(model, p, **kw, step=(steps or (ar_step,))[0])


def speculative(model, tree, kw, steps=None):
    """The decoder of a tree: Speculative Streaming, or plain decoding for the tree `none`
    (None); with the steps given (eager: None)."""
    if tree is None:
        return plain(model, kw, steps)
    step = steps[1] if steps else speculative_step
    return lambda p: generate_speculative(model, p, tree=tree, **kw, step=step)


def repeat_rate(outputs, n=12):
    """Share of the n-grams of the outputs that already occurred earlier in the same output:
    how much the decoded text repeats itself. A loop is easy to draft, so CR measures the
    drafter and the text together; it compares models with different main streams only
    at similar repeat rates (greedy decoding of a small model often falls into loops)."""
    repeated = total = 0
    for out in outputs:
        seen = set()
        for i in range(len(out) - n + 1):
            gram = tuple(out[i:i + n])
            repeated, total = repeated + (gram in seen), total + 1
            seen.add(gram)
    return repeated / total if total else 0.0


def rows_of(results):
    """The output of every row of (output, Stats) results, a batch's rows one by one."""
    return [row for out, _ in results
            for row in (out if out and isinstance(out[0], list) else [out])]


def summarize(ar, ss):
    """The report's metrics from the (tokens, Stats) results of run_pair (one per prompt, or
    per batch of prompts). latency: the mean time until a prompt's output is complete."""
    toks = lambda rs: sum(s.full_tokens for _, s in rs)
    secs = lambda rs: sum(s.full_seconds for _, s in rs)
    passes = lambda rs: sum(s.full_passes for _, s in rs)
    accepted = [a for _, s in ss for a in s.accepted]
    from_text = sum(t for _, s in ss for t in s.from_text)
    nodes = [n for _, s in ss for n in s.nodes]
    ar_tps, ss_tps = toks(ar) / secs(ar), toks(ss) / secs(ss)
    # the spans of a batch end at different tokens
    cr = (toks(ss) / passes(ss)) / (toks(ar) / passes(ar))
    ar_rows, ss_rows = rows_of(ar), rows_of(ss)
    match = [a == b for a, b in zip(ar_rows, ss_rows)]
    first = next(((i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                           min(len(a), len(b))))
                  for i, (a, b) in enumerate(zip(ar_rows, ss_rows)) if a != b), None)
    latency = lambda rs: statistics.mean(t for _, s in rs for t in (s.row_seconds or [s.seconds]))
    hist = {}
    for a in accepted:
        hist[a] = hist.get(a, 0) + 1
    whole = lambda rs: sum(s.new_tokens for _, s in rs) / sum(s.seconds for _, s in rs)
    return dict(ar_tokens_per_s=ar_tps, ss_tokens_per_s=ss_tps, speedup=ss_tps / ar_tps,
                drained_speedup=whole(ss) / whole(ar),
                mean_accepted=sum(accepted) / max(1, len(accepted)), call_reduction=cr,
                efficiency=ss_tps / ar_tps / cr, match_rate=sum(match) / len(match),
                first_divergence=first, ar_ms_per_pass=1000 * secs(ar) / passes(ar),
                ss_ms_per_pass=1000 * secs(ss) / passes(ss),
                accepted_histogram=dict(sorted(hist.items())),
                new_tokens=sum(s.new_tokens for _, s in ss),
                mean_nodes=sum(nodes) / max(1, len(nodes)), repeat_rate=repeat_rate(ar_rows),
                # of the accepted drafts, the share drafted from the text (a lookup branch's)
                text_share=from_text / max(1, sum(accepted) - len(accepted)),
                ar_latency_s=latency(ar), ss_latency_s=latency(ss))


def over_runs(summaries):
    """One summary of several runs of the same decoders on the same prompts: the median
    run's metrics, with the speedup of every run and their range."""
    speedups = [r["speedup"] for r in summaries]
    median = sorted(range(len(summaries)), key=lambda i: speedups[i])[(len(summaries) - 1) // 2]
    return {**summaries[median], "speedups": speedups,
            "speedup_range": [min(speedups), max(speedups)], "runs": len(summaries),
            "median_run": median, "match_rate": min(r["match_rate"] for r in summaries)}


def prompt_speedups(ar, ss, busy=False):
    """The speedup on each prompt (or queue) of one run over its whole decode, drain included:
    the tree search's measure. Near the batch size where speculation stops paying, a queue's
    slowest rows decide whether a tree still pays, so the search errs toward plain decoding.
    busy=True: while all its rows decode instead (as tokens/s counts them; a prompt alone: the
    same), the search's tie-break."""
    rate = (lambda st: st.full_tokens / st.full_seconds) if busy else (lambda st: st.tokens_per_s)
    return [rate(s) / rate(a) for (_, a), (_, s) in zip(ar, ss)]


def threads():
    """'1 thread', '2 threads': torch's intra-op threads, for a report line."""
    n = torch.get_num_threads()
    return f"{n} thread" + "s" * (n != 1)


def machine(device, dtype):
    """What the numbers were measured on: the processor (the GPU's name on CUDA), threads,
    torch version and dtype."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or "unknown processor"
        if os.path.exists("/proc/cpuinfo"):
            models = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                      if line.startswith("model name")]
            name = models[0] if models else name
    return dict(processor=name, device=device, threads=torch.get_num_threads(),
                torch=torch.__version__, dtype=str(dtype).replace("torch.", ""))


def products(model, n_nodes, draft_depth=None, batch_size=1):
    """The matrix products of one pass over n_nodes nodes, alone: every Linear of every layer on
    the rows that the pass carries (n_nodes main rows below the multi-stream layers,
    n_nodes (1 + g) rows in them, g streams as in GPT.forward_nodes), the LM head on the main
    and stream rows in one call, as GPT.heads makes it (Medusa: the main rows, then its heads).
    draft_depth=0: an autoregressive pass (one row everywhere, no draft logits). Returns a
    function that runs them."""
    cfg, w, g = model.config, model.lm_head.weight, model.streams_in_pass(draft_depth)
    first = model.first_msa_layer(g)
    n = n_nodes
    rows = [n * (1 + g) if i >= first else n for i in range(cfg.n_layer)]
    x = {r: w.new_zeros(batch_size, r, cfg.n_embd) for r in set(rows) | {n, n * (1 + g)}}
    hidden = 4 * cfg.n_embd  # the MLP's inner width
    xh = {r: w.new_zeros(batch_size, r, hidden) for r in set(rows)}

    def run():
        for block, r in zip(model.transformer.h, rows):
            block.attn.c_attn(x[r]), block.attn.c_proj(x[r])
            block.mlp.c_fc(x[r]), block.mlp.c_proj(xh[r])
        model.lm_head(x[n * (1 + g)])
        if not g and draft_depth != 0:
            for head in getattr(model, "medusa_heads", [])[:draft_depth]:
                head(x[n])
    return run


def step_bytes(model, cache_len, rows=1):
    """Bytes one decoding step must read at least: every weight of the blocks and the LM head
    once (an embedding row and a LayerNorm are negligible), and the keys and values of the
    cached tokens in every layer, for each of `rows` batch rows. An autoregressive step and a
    tree pass read the same."""
    cfg = model.config
    blocks = sum(p.numel() * p.element_size() for name, p in model.transformer.h.named_parameters()
                 if ".stream_adapter." not in name)
    head = model.lm_head.weight
    kv = rows * cfg.n_layer * 2 * cache_len * cfg.n_embd * head.element_size()
    return blocks + head.numel() * head.element_size() + kv


def synchronize(device):
    """Wait for the device's queued work, so that a timer sees the work and not its launch."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


@functools.cache
def copy_bandwidth(device, dtype=torch.float32, mb=256, repeats=5):
    """This machine's memory bandwidth as a large tensor copy sees it (bytes read + written per
    second, best of `repeats`): the roof that a memory-bound decoding step can approach. Measured
    once per process, so that every step of a report is held against the same roof."""
    src = torch.ones(mb * 2**20 * 8 // torch.finfo(dtype).bits, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


@torch.inference_mode()
def pass_cost(model, context, sizes=(1, 4, 8, 16), steps=100, warmup=10, batch_size=1,
              compiled=False, temperature=0.0, top_k=None, top_p=None):
    """Wall time of one whole speculative step over a budget tree of n nodes (draft, forward,
    verify, accept: `speculative_step`) divided by that of one autoregressive step
    (`ar_step` and its host sync), after a prefill of `context` tokens, greedy; median over
    `steps` steps of each, interleaved, each timed right after one of its own kind (a compiled
    step's frozen weights are its own copy: after other steps they would be out of the CPU's
    caches, as they never are in decoding). Every step starts from the same cache length,
    root and drafts; batch_size rows, all of the same context, step together. temperature > 0:
    both steps sample (their random draws made ahead, as the decoders make them).

    Also the floor that no leaner step goes below on this machine, up to the timing's noise
    (a few hundredths): 1 + (the matrix products of the speculative pass - those of the
    autoregressive pass) / one autoregressive step, timed in the same loop (`products`),
    on zero inputs and apart from the step. The extra rows of a tree pass
    cost this much even if everything else in the step cost exactly what it costs in an
    autoregressive step. Returns ({n: ratio}, {n: floor}, the median AR step in ms)."""
    cfg, dev, dtype = model.config, model.lm_head.weight.device, model.lm_head.weight.dtype
    T, L = cfg.block_size, len(context)
    trees = {n: BudgetTree(n).bind(cfg, dev, dtype) for n in sizes}
    sampler = Sampler(temperature, top_k, top_p, 0, dev)
    rows = [list(context)] * batch_size  # every row the same: a batch of batch_size
    for t in trees.values():
        t.bind(cfg, dev, dtype, batch_size)
    caches = {n: prefill(model, rows, t.draft_depth, t.max_len) for n, t in trees.items()}
    caches["ar"] = prefill(model, rows, 0, T)
    root, window = sampler.pick(caches["ar"][1]), ar_window(caches["ar"][0])
    plain, spec = ar_step, speculative_step
    if compiled:
        plain, spec = compile_step(ar_step), compile_step(speculative_step)

    def ar():
        sampler.draw_ahead(batch_size, cfg.vocab_size)
        plain(model, caches["ar"][0], root, sampler, window).tolist()

    def ss(n, t):
        cache, _, q = caches[n]
        sampler.draw_ahead(batch_size, cfg.vocab_size, t)
        spec(model, cache, root, q, t, sampler).n_emitted.tolist()

    steps_of = {"ar": ar, "products ar": products(model, 1, draft_depth=0, batch_size=batch_size),
                **{n: (lambda n=n, t=t: ss(n, t)) for n, t in trees.items()},
                **{f"products {n}": products(model, n, t.draft_depth, batch_size)
                   for n, t in trees.items()}}
    times = {k: [] for k in steps_of}
    for i in range(warmup + steps):
        keys = list(steps_of)
        for k in keys[i % len(keys):] + keys[:i % len(keys)]:
            # time the second of two: in decoding a step follows its own kind
            for warm in (False, True):
                synchronize(dev)
                t0 = time.perf_counter()
                steps_of[k]()
                synchronize(dev)
                if warm and i >= warmup:
                    times[k].append(time.perf_counter() - t0)
                for cache, _, _ in caches.values():  # every step from the same length
                    cache.advance(L - cache.length)
    med = {k: statistics.median(v) for k, v in times.items()}
    costs = {n: med[n] / med["ar"] for n in sizes}
    floors = {n: 1 + (med[f"products {n}"] - med["products ar"]) / med["ar"] for n in sizes}
    return costs, floors, 1000 * med["ar"]


def unreliable(what):
    """Warn, on stderr, that a measurement cannot be right as measured."""
    print(f"warning: {what}: another process is probably competing for the cores, so these "
          "measurements are unreliable; rerun on an idle machine", file=sys.stderr, flush=True)


def tree_name(tree):
    return f"{tree} ({len(tree)} nodes)" if tree else "none (plain decoding: no tree pays here)"


def others_report(runs, r, tree, others, log):
    """The trees measured beside the answer (the last decoders of each run) against plain
    decoding and the answer's tree: ({kind: its summary}, a line for each)."""
    out, lines = {}, []
    for j, (name, t) in enumerate(others.items(), start=len(runs[0]) - len(others)):
        xs = [summarize(run[0], run[j]) for run in runs]
        ratio = [summarize(*run[:2])["ss_tokens_per_s"] / x["ss_tokens_per_s"]
                 for run, x in zip(runs, xs)]
        m, (lo, hi) = xs[r["median_run"]], (min(x["speedup"] for x in xs),
                                            max(x["speedup"] for x in xs))
        lines.append(f"{name} ({t}): {m['speedup']:.2f}x plain ({lo:.2f}-{hi:.2f}x), tau "
                     f"{m['mean_accepted']:.2f}{sources(m, t)}; tree {tree_name(tree)} "
                     f"{statistics.median(ratio):.2f}x it" + " (a baseline, not the method)"
                     * (name == "prompt lookup"))
        out[name] = dict(m, tree=str(t), speedups=[x["speedup"] for x in xs],
                         tree_over_this=ratio)
        log("  " + lines[-1])
    return out, lines


def sources(r, tree):
    """', accepted drafts X% from the streams, Y% from the text' for a tree with a lookup
    branch beside its streams ('' otherwise)."""
    if tree is None or not (tree.lookup_length and tree.ks):
        return ""
    return (f", accepted drafts {1 - r['text_share']:.0%} from the streams, "
            f"{r['text_share']:.0%} from the text")
