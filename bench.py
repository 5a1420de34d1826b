"""Measure Speculative Streaming against KV-cached autoregressive decoding, in one process.

    python bench.py                        # default checkpoint (out/), held-out prompts, greedy
    python bench.py --temperature=0.8      # sampling: the realistic number (greedy: exactness)
    python bench.py --suite                # every row of the README's results table, an example
    python bench.py --tree=3,2,1           # the paper's Cartesian tree; --tree=n16 a 16-node budget
    python bench.py --tree=auto            # pick the tree on calibration prompts first (default)
    python bench.py --repeats=5            # one tree search, then 5 measurement runs: median, range
                                           # (sampling: run i draws with --seed + i)
    python bench.py --sweep                # tokens/s over tree shapes and budgets, best marked
    python bench.py --profile              # where a speculative step spends its time
    python bench.py --train_steps=10       # also ms/iter of training with and without streams
    python bench.py --json                 # one JSON document on stdout (the report on stderr)
    python bench.py --pass_cost            # one speculative step's cost, in autoregressive steps
    python bench.py --pass_cost --temperature=0.8   # the same, both steps sampling
    python bench.py --compile=True         # also both decoders with torch.compile, against eager
    python bench.py --compare=out-ft-plain,out-ft-ss,out-ft-medusa   # the paper's Table 1, here
    python bench.py --plot=search.png      # the tree search as a figure (pip install -e ".[plot]")
    python bench.py --batch_size=8         # 8 prompts decoded at once (rows of different lengths)
    python bench.py --batch_sweep          # batch sizes 1..32+: where speculation stops paying
    python bench.py --threads=1            # one CPU thread: steadier where a second core is shared

The report's first line is the answer: the median speedup over --repeats runs with its
range, the tree and the decoding mode; the details follow. The metrics (tokens/s, passes,
tau, CR, speedup, efficiency, repeat rate, median and range) are defined in
ss_mini/lab/measure.py.
"""
import json
import os
import sys
import time

import torch

from ss_mini.lab import plot
from ss_mini.lab.batch_sweep import batch_sweep
from ss_mini.io.checkpoint import load_model, param_counts
from ss_mini.io.cli import (UsageError, at_least, check, in_range, parse_args, pick_device,
                            pick_dtype, warn_unused)
from ss_mini.io.data import describe_fingerprint
from ss_mini.extras.pruning import pruned_step
from ss_mini.baseline import generate_ar
from ss_mini.generate import generate_speculative
from ss_mini.lab.compare import compare, describe
from ss_mini.lab.measure import (compiled_steps, machine, others_report, over_runs, plain,
                                 run_interleaved, run_kwargs, run_pair, sources, speculative,
                                 summarize, threads, tree_name, tree_spec, unreliable)
from ss_mini.lab.report import suite_markdown
from ss_mini.lab.step_cost import profile, roofline, step_costs, train_bench
from ss_mini.lab.suite import suite
from ss_mini.extras import make_tree
from ss_mini.lab.tree_choice import (METHOD, batched, calibration_batches, choose_trees,
                                     decode_kwargs, kind, n_prompts, pick_prompts)

config = dict(
    out_dir="out",  # the checkpoint to measure (out_dir/ckpt.pt)
    # "" = held-out validation snippets; or a JSON-lines file of {"prompt": "..."} whose first
    # few calibrate
    prompts="",
    # prompts measured (and 2/3 as many more held-out ones calibrate the tree search)
    num_prompts=12,
    prompt_tokens=64,  # length of a validation snippet
    max_new_tokens=256,  # new tokens per prompt
    temperature=0.0,  # 0 = greedy (and the exactness check); > 0 samples
    top_k=0,  # 0 = off
    top_p=1.0,  # 1.0 = off
    seed=1337,  # the sampling seed of the first run (run i: seed + i)
    # top-k per depth (e.g. 1,1,1 or 3,2,1), nN for an N-node budget, none (plain decoding), or
    # auto; +LM adds a branch of M tokens drafted from the decoded text (1,1+L8), LM alone is
    # prompt-lookup decoding (extras/lookup.py)
    tree="auto",
    # the trees auto and sweep try
    candidates=("none;1,1;1,1,1;1,1,1,1;2,1,1;3,2,1;n4;n8;n16;"
                "L4;L8;L12;1+L4;1+L8;1+L12;1,1+L8;2,1+L8;1,1,1+L8"),
    # prompts decoded at once, as one batch (rows drawn from the prompts, of different lengths)
    batch_size=1,
    # plain and speculative tokens/s at batch sizes 1, 2, 4, ... (a tree search at each)
    batch_sweep=False,
    batch_candidates="none;1;1,1;1,1,1;1,1,1,1;2,1,1;n8;L8;1+L8",  # what --batch_sweep tries
    # --batch_sweep: 1, 2, 4, ..., 32, then on while plain decoding still gains 10%, up to this
    # (size B decodes 4 B prompts a run, which keeps the sweep within minutes)
    max_batch_size=256,
    # new tokens per calibration prompt in the tree search (at most max_new_tokens)
    calibration_tokens=256,
    # the search takes the fewest nodes (then the highest tau) within this fraction of the fastest
    # (and, in a batch, of the busiest of those: tree_choice.tree_search)
    tie_margin=0.02,
    # measurement runs after one tree search (each batch size of --batch_sweep): the median
    # speedup and its range
    repeats=3,
    # every row of the README's results table and a worked example, as Markdown (or --json)
    suite=False,
    # CODE_DIR,PROSE_DIR: the checkpoints --suite measures; several per model joined by +
    # (out+out-seed7+out-seed42,...: the spread over training seeds)
    suite_dirs="out,out-shakespeare",
    sweep=False,  # tokens/s over every candidate tree, best marked
    profile=False,  # where a speculative step spends its time (torch.profiler)
    train_steps=0,  # > 0: also time this many training steps with and without streams
    device="auto",  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    # auto (bf16/fp16 on CUDA, fp32 elsewhere) | float32 | bfloat16 | float16 | float64
    dtype="auto",
    threads=0,  # torch CPU threads; 0 = torch's default
    json=False,  # one JSON document on stdout (the report on stderr)
    # > 0: also run with parallel tree pruning (a model with a pruning adapter)
    prune_threshold=0.0,
    # DIR1,DIR2,...: a Table-1 style report of models fine-tuned from one base on one dataset
    compare="",
    # the cost of one speculative step over n = 1, 4, 8, 16 nodes, in autoregressive steps
    pass_cost=False,
    # N_LAYER,N_HEAD,N_EMBD,VOCAB: --pass_cost on a random model of this shape (gamma=3, Ns=2,
    # block 1024)
    shape="",
    # also run both decoders with the forward pass compiled (torch.compile), interleaved with eager
    compile=False,
    # eager decoding on a CPU with packed weights and a lean cache, for both decoders
    # (extras/kernels.py, the same values); False: the method's own classes (README: code paths)
    lean=True,
    plot="",  # FILE.png: the tree search's speedup and tau against tree nodes (needs matplotlib)
)
RULES = dict(num_prompts=at_least(1), prompt_tokens=at_least(1), max_new_tokens=at_least(1),
             temperature=at_least(0.0), top_k=at_least(0), top_p=in_range(0.0, 1.0, lo_open=True),
             train_steps=at_least(0), threads=at_least(0), prune_threshold=in_range(0.0, 1.0),
             calibration_tokens=at_least(1), tie_margin=in_range(0.0, 1.0, hi_open=True),
             repeats=at_least(1), batch_size=at_least(1), max_batch_size=at_least(1),
             prompts=(lambda v: not v or os.path.isfile(v),
                      "a JSON-lines file that exists (or empty)"),
             suite_dirs=(lambda v: len(v.split(",")) == 2 and all(all(d.split("+"))
                                                                   for d in v.split(",")),
                         "two folders, CODE_DIR,PROSE_DIR, each DIR or DIR+DIR+..."))
NOT_WITH_SUITE = ("out_dir", "prompts", "temperature", "sweep", "profile", "compare", "pass_cost",
                  "compile", "prune_threshold", "train_steps", "batch_size",
                  "batch_sweep")  # --suite sets these per row


def mode_of(temperature):
    return "greedy" if temperature == 0 else f"sampling at temperature {temperature:g}"


def repeats_note(rate):
    """What the report says when the speedup is mostly that of drafting loops."""
    return (f"most of this speedup is drafting repeated text: {rate:.0%} of the output's 12-grams "
            "occurred earlier in it" if rate > 0.5 else "")


def searched(cfg):
    """Whether bench searches the trees (--tree=auto, or --sweep)."""
    return cfg["tree"] == "auto" or cfg["sweep"]


def load_drafter(cfg, device, dtype):
    """(model, tokenizer, checkpoint) of --out_dir, a model with a drafter; a --tree that does
    not fit it is an error before any work."""
    model, tok, ckpt = load_model(cfg["out_dir"], device, getattr(torch, dtype), cfg["lean"])
    if model.config.n_drafts == 0:
        raise UsageError(f"{cfg['out_dir']} has no drafter (n_streams=0): train one with "
                         "--n_streams=3")
    tree = make_tree(cfg["tree"], model.config.n_drafts) if cfg["tree"] != "auto" else None
    if tree:
        tree.bind(model.config, device, getattr(torch, dtype))
    return model, tok, ckpt


def bench_prompts(cfg, ckpt, tok):
    """(prompts, calibration prompts, how many prompts were given) as bench decodes them: one
    by one, or in queues of --batch_size rows (`batched`)."""
    prompts, calibration = pick_prompts(cfg, ckpt, tok)
    B = cfg["batch_size"]
    if cfg["compile"] and cfg["prune_threshold"]:
        raise UsageError("--prune_threshold decides on the host which nodes survive, which a "
                         "compiled step cannot: drop --compile or --prune_threshold")
    if B > 1 and cfg["prune_threshold"]:
        raise UsageError("--prune_threshold decodes one prompt at a time: give --batch_size=1")
    return batched(prompts, B), calibration_batches(calibration, B), len(prompts)


def batch_note(cfg, given, queues):
    """The report's line on what a batch decodes: the queues of `batched`, filled with copies
    of the given prompts where these are too few."""
    B, n, size = cfg["batch_size"], n_prompts(queues), max(len(q) for q in queues)
    where = "held-out" if not cfg["prompts"] else cfg["prompts"]
    if n > given:
        return (f"decoding {n} prompts, not {given}: at --batch_size={B} the {given} {where} "
                f"prompts are cycled to fill {len(queues)} queues of {size} ({size // B} waves of "
                f"{B} rows each), each copy keeping a different number of its last tokens")
    return (f"decoding {n} {where} prompts in {len(queues)} queues of {size}, {B} rows at once, "
            "each keeping a different number of its last tokens")


def log_setup(cfg, model, ckpt, prompts, calibration, given, device, dtype, log):
    """The report's lines on the model, the machine, the prompts of a batch and the corpus (and
    on prompts too few to keep calibration apart)."""
    if calibration[0] in prompts and searched(cfg):
        log(f"note: {cfg['prompts']} holds too few prompts to keep calibration apart: the tree "
            "is tuned on the prompts it is measured on (give more prompts, or --tree)")
    base, draft = param_counts(model)
    B = cfg["batch_size"]
    log(f"model {cfg['out_dir']}: {model.config.n_layer} layers x {model.config.n_embd}, "
        f"drafter: {describe(model.config)}; {base:,} base + {draft:,} draft parameters; "
        f"{device} {dtype}, {threads()}" + (f"; {B} prompts at once" if B > 1 else ""))
    if B > 1:
        log(batch_note(cfg, given, prompts))
    log(f"corpus: {describe_fingerprint(ckpt.get('corpus'))}")


def measured_runs(model, prompts, calibration, tree, others, kw, cfg, log, progress):
    """--repeats runs of plain and speculative decoding (and both compiled, with --compile; and
    last the trees of `others`: prompt lookup alone, the other kind of stream tree), interleaved
    on every prompt; each run a list of results per decoder. Sampling, run i draws with
    --seed + i (`run_kwargs`)."""
    steps = compiled_steps() if cfg["compile"] else None
    if steps:
        t0 = time.perf_counter()
        run_pair(model, calibration, tree, kw, steps)  # compiles the token and the tree steps
        log(f"torch.compile: {time.perf_counter() - t0:.0f} s of compilation and warm-up")
    runs = []
    for i in range(cfg["repeats"]):
        progress(f"bench: run {i + 1}/{cfg['repeats']}")
        kw_i = run_kwargs(kw, i)
        decoders = [lambda p: generate_ar(model, p, **kw_i), speculative(model, tree, kw_i)]
        if steps:
            decoders += [plain(model, kw_i, steps), speculative(model, tree, kw_i, steps)]
        decoders += [speculative(model, t, kw_i) for t in others.values()]
        runs.append(run_interleaved(prompts, decoders))
    return runs


def prompts_phrase(cfg, prompts):
    """'12 held-out prompts' (or the --prompts file's), with ', B at once' for a batch."""
    where = "held-out" if not cfg["prompts"] else cfg["prompts"]
    B, n = cfg["batch_size"], n_prompts(prompts)
    return f"{n} {where} prompt{'s' * (n != 1)}" + (f", {B} at once" if B > 1 else "")


def answer_lines(cfg, r, runs, tree, kw, n):
    """The report's first line (and the note on repeated text where it applies)."""
    lo, hi = r["speedup_range"]
    spread = f"{lo:.2f}-{hi:.2f}x over {len(runs)} runs" if len(runs) > 1 else "1 run"
    last = run_kwargs(kw, len(runs) - 1)["seed"]
    if last != kw["seed"]:  # sampling: run i drew with seed + i
        spread += f", seeds {kw['seed']} to {last}"
    what = "Speculative Streaming" if kind(tree_spec(tree)) in METHOD else "decoding"
    return ([f"{what} speedup {r['speedup']:.2f}x ({spread}), tree {tree_name(tree)}, "
             f"{mode_of(cfg['temperature'])}: {cfg['out_dir']}, {n} x {kw['max_new_tokens']} new "
             f"tokens, tau {r['mean_accepted']:.2f}{sources(r, tree)}"]
            + [repeats_note(r["repeat_rate"])] * (r["repeat_rate"] > 0.5 and tree is not None))


def log_table(cfg, r, runs, tree, kw, n, log):
    """The median run's figures, plain against speculative decoding."""
    B = cfg["batch_size"]
    log(f"\n{f'the median of {len(runs)} runs' if len(runs) > 1 else '1 run'} (speedups "
        f"{', '.join(f'{x:.2f}x' for x in r['speedups'])}), {n} x {kw['max_new_tokens']} new "
        f"tokens, {mode_of(cfg['temperature'])}, tree {tree_name(tree)}:")
    log(f"  {'':24} {'autoregressive':>15} {'speculative':>12}")
    log(f"  {'tokens/s':24} {r['ar_tokens_per_s']:15.1f} {r['ss_tokens_per_s']:12.1f}")
    log(f"  {'ms per forward pass':24} {r['ar_ms_per_pass']:15.2f} {r['ss_ms_per_pass']:12.2f}")
    log(f"  {'latency (s)':24} {r['ar_latency_s']:15.3f} {r['ss_latency_s']:12.3f}")
    log(f"  speedup {r['speedup']:.2f}x | tau (tokens per pass: accepted drafts + 1) "
        f"{r['mean_accepted']:.2f} | call-reduction {r['call_reduction']:.2f} | efficiency "
        f"{r['efficiency']:.2f}")
    if B > 1:
        log(f"  tokens/s while all {B} rows decode; over each queue's whole decode, its drain "
            f"included (the last rows finishing one by one): speedup {r['drained_speedup']:.2f}x "
            "(measure.py); latency: the mean time until a prompt's output is complete")
    log(f"  accepted-length histogram: {r['accepted_histogram']} | the output repeats itself: "
        f"{r['repeat_rate']:.0%} of its 12-grams occurred earlier in it")
    if r["efficiency"] > 1 and tree is not None:
        unreliable(f"efficiency {r['efficiency']:.2f} > 1 (a speculative pass cannot cost less "
                   "than a plain one)")
    if cfg["temperature"] == 0:
        div = r["first_divergence"]
        log(f"  greedy outputs identical to plain decoding on {100 * r['match_rate']:.0f}% of "
            "prompts (in every run)" if r["match_rate"] == 1
            else f"  greedy outputs identical on {100 * r['match_rate']:.0f}% of prompts (the "
            "lowest run)" + (f"; first divergence: prompt {div[0]}, token {div[1]}" if div else ""))


def compiled_report(model, run, cfg, device, dtype, log):
    """The median run's compiled decoders against its eager ones: (their summary, the line for
    the answer)."""
    c = summarize(*run[2:])
    c["roof"] = roofline(model, cfg["batch_size"], device, dtype,
                         {"compiled plain": c["ar_ms_per_pass"],
                          "compiled speculative": c["ss_ms_per_pass"]})
    log(c["roof"].pop("line"))
    m = summarize(*run[:2])
    log(f"  with torch.compile (the median run): autoregressive {c['ar_tokens_per_s']:.1f} "
        f"tokens/s ({c['ar_tokens_per_s'] / m['ar_tokens_per_s']:.2f}x eager), speculative "
        f"{c['ss_tokens_per_s']:.1f} ({c['ss_tokens_per_s'] / m['ss_tokens_per_s']:.2f}x eager): "
        f"speedup {c['speedup']:.2f}x over compiled autoregressive, "
        f"{c['ss_tokens_per_s'] / m['ar_tokens_per_s']:.2f}x over eager"
        + (f"; greedy outputs identical on {100 * c['match_rate']:.0f}% of prompts"
           if cfg["temperature"] == 0 else ""))
    line = (f"compiled (the median run): plain "
            f"{c['ar_tokens_per_s'] / m['ar_tokens_per_s']:.2f}x and speculative "
            f"{c['ss_tokens_per_s'] / m['ss_tokens_per_s']:.2f}x their eager tokens/s, "
            f"speculative {c['speedup']:.2f}x compiled plain")
    return c, line


def pruning_report(model, prompts, tree, kw, thr, log):
    """Plain, speculative and pruned speculative decoding, interleaved (--prune_threshold)."""
    g = model.streams_in_pass(tree.draft_depth)
    ar, ss, sp = run_interleaved(prompts, [
        lambda p: generate_ar(model, p, **kw),
        lambda p: generate_speculative(model, p, tree=tree, **kw),
        lambda p: generate_speculative(model, p, tree=tree, **kw, step=pruned_step(model, thr))])
    u, p = summarize(ar, ss), summarize(ar, sp)
    log(f"  parallel tree pruning at threshold {thr} (AR, SS and pruned SS interleaved); nodes a "
        f"pass enter the MSA layers, each but a draft from the text with {g} stream rows:")
    for name, x in (("without pruning", u), ("with pruning", p)):
        log(f"    {name:<16} {x['mean_nodes']:6.1f} nodes a pass, {x['ss_tokens_per_s']:7.1f} "
            f"tokens/s, speedup {x['speedup']:.2f}x, tau {x['mean_accepted']:.2f}, identical "
            f"{100 * x['match_rate']:.0f}%")
    return {"threshold": thr, "unpruned": u, "pruned": p}


def bench(cfg, device, dtype, progress):
    """`python bench.py`: the tree (searched, or --tree), then --repeats measurement runs of
    both decoders, interleaved on every prompt. Returns the JSON result and the report, whose
    first line is the answer."""
    model, tok, ckpt = load_drafter(cfg, device, dtype)
    prompts, calibration, given = bench_prompts(cfg, ckpt, tok)
    B = cfg["batch_size"]
    details = []
    log = details.append
    kw = decode_kwargs(cfg, tok)
    log_setup(cfg, model, ckpt, prompts, calibration, given, device, dtype, log)
    progress("bench: tree search" if searched(cfg) else "bench: warm-up")
    tree, others = choose_trees(model, calibration, cfg, kw, log)
    if searched(cfg) and calibration[0] not in prompts:
        log("(the search ran on its own prompts, kept apart from those measured below: their "
            "speedups differ)")
    if cfg["profile"]:
        profile(model, prompts, tree, kw, log)
    runs = measured_runs(model, prompts, calibration, tree, others, kw, cfg, log, progress)
    r = over_runs([summarize(*run[:2]) for run in runs])
    n = prompts_phrase(cfg, prompts)
    answer = answer_lines(cfg, r, runs, tree, kw, n)
    log_table(cfg, r, runs, tree, kw, n, log)
    base, draft = param_counts(model)
    log(f"  draft parameters {draft:,} vs base parameters {base:,} ({draft / base:.1e})")
    roof = roofline(model, B, device, dtype,
                    {"plain": r["ar_ms_per_pass"], "speculative": r["ss_ms_per_pass"]})
    log(roof.pop("line"))
    result = {}
    if others:
        result["others"], lines = others_report(runs, r, tree, others, log)
        result["lookup_only"] = result["others"].get("prompt lookup")
        answer[1:1] = lines
    if cfg["compile"]:
        median = runs[r["median_run"]][:4]  # plain, speculative, both compiled
        result["compiled"], line = compiled_report(model, median, cfg, device, dtype, log)
        answer.insert(1, line)
    if cfg["prune_threshold"]:
        result["pruning"] = pruning_report(model, prompts, tree, kw, cfg["prune_threshold"], log)
    if cfg["train_steps"]:
        result.update(train_bench(ckpt, device, cfg["train_steps"], log))
    result.update(r, roof=roof, tree=tree_spec(tree), tree_nodes=len(tree) if tree else 0,
                  batch_size=B, draft_params=draft, base_params=base, device=device, dtype=dtype,
                  threads=torch.get_num_threads(), prompts=n_prompts(prompts),
                  max_new_tokens=kw["max_new_tokens"], temperature=cfg["temperature"],
                  corpus=ckpt.get("corpus"), machine=machine(device, dtype), report=answer[0])
    return result, answer + details


def check_flags(cfg):
    """What can be checked before any work: every value, --plot's needs, every tree's syntax and
    what combines with --suite."""
    check(cfg, RULES)
    if cfg["plot"]:  # matplotlib, the file and one tree search (or the batch sweep) to draw
        drawn = ((cfg["tree"] == "auto" or cfg["sweep"] or cfg["batch_sweep"])
                 and not (cfg["compare"] or cfg["pass_cost"] or cfg["suite"]))
        plot.check(cfg["plot"], drawn)
    trees = ([cfg["tree"]] * (cfg["tree"] != "auto") + cfg["candidates"].split(";")
             + cfg["batch_candidates"].split(";"))
    for spec in trees:  # depths are checked against the model later
        make_tree(spec, 99)
    if cfg["suite"]:
        clash = [k for k in NOT_WITH_SUITE if cfg[k] != config[k]]
        if clash:
            raise UsageError(f"--{clash[0]} does not combine with --suite, which runs its own "
                             "rows (--suite_dirs=CODE_DIR,PROSE_DIR picks the checkpoints)")
    else:
        warn_unused(cfg, config, ("suite_dirs",), "without --suite")


def main(argv=None):
    flags = ("sweep", "profile", "json", "pass_cost", "suite", "batch_sweep")
    cfg = parse_args(config, argv, __doc__, flags=flags)
    check_flags(cfg)
    device = pick_device(cfg["device"])
    dtype = pick_dtype(cfg["dtype"], device)
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    out = sys.stderr if cfg["json"] else sys.stdout  # with --json, stdout holds only the JSON
    log = lambda *a: print(*a, file=out, flush=True)
    # what it is doing, for a person at a terminal; piped, stderr holds only warnings and (--json)
    # the report
    progress = ((lambda line: print(line, file=sys.stderr, flush=True)) if sys.stderr.isatty()
                else (lambda line: None))
    if cfg["pass_cost"]:
        result = step_costs(cfg, device, getattr(torch, dtype), log)
    elif cfg["compare"]:
        result = compare(cfg["compare"].split(","), cfg, device, getattr(torch, dtype), log)
    elif cfg["batch_sweep"]:
        result = batch_sweep(cfg, device, dtype, progress, log, mode_of(cfg["temperature"]))
    elif cfg["suite"]:
        import sample  # its defaults: the worked example's commands leave them out
        result = suite(cfg, config, sample.config, device, dtype, progress)
        log(suite_markdown(result))
    else:
        result, report = bench(cfg, device, dtype, progress)
        log("\n".join(report))
    if cfg["json"]:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")
