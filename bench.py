"""Measure Speculative Streaming against KV-cached autoregressive decoding, in one process.

    python bench.py                        # default checkpoint (out/), held-out prompts, greedy
    python bench.py --tree=3,2,1           # the paper's Cartesian tree; --tree=n16 a 16-node budget
    python bench.py --tree=auto            # pick the fastest tree on calibration prompts first
    python bench.py --sweep                # tokens/s over tree shapes and budgets, best marked
    python bench.py --profile              # where a speculative step spends its time
    python bench.py --train_steps=10       # also ms/iter of training with and without streams
    python bench.py --json                 # one JSON document as the last line

Metrics (defined once): tokens/s = new tokens / wall time of the whole generation, prefill
included; passes = forward passes (prefill counted in both decoders); mean accepted
tau = tokens per decode pass, root included; call-reduction CR = AR passes / SS passes;
speedup = SS tokens/s / AR tokens/s; efficiency = speedup / CR. The two decoders run on
the same prompts, interleaved, after a warm-up, so that drift of the machine hits both.
"""
import cProfile
import json
import pstats
import statistics
import sys
import time

import numpy as np
import torch

from ss_mini.checkpoint import load_model
from ss_mini.cli import UsageError, parse_args, pick_device, pick_dtype
from ss_mini.data import load_split, prepare
from ss_mini.generate import generate_ar, generate_speculative
from ss_mini.tree import make_tree

config = dict(
    out_dir="out",
    prompts="",  # "" = held-out validation snippets; or a JSON-lines file of {"prompt": "..."}
    num_prompts=12,
    prompt_tokens=64,  # length of a validation snippet
    max_new_tokens=256,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed=1337,
    tree="auto",  # top-k per depth (e.g. 1,1,1 or 3,2,1), nN for an N-node budget, or auto
    candidates="1,1,1;2,1,1;3,1,1;2,2,1;3,2,1;n4;n6;n8;n12;n16;n24;n32",  # trees that auto and sweep try
    sweep=False,
    profile=False,
    train_steps=0,  # > 0: also time this many training steps with and without streams
    device="cpu",
    dtype="float32",
    threads=0,  # torch CPU threads; 0 = torch's default
    json=False,
)


def validation_prompts(ckpt, tok, n, length):
    """n snippets of the checkpoint's held-out validation split, each starting at a line start."""
    tcfg = ckpt["config"]
    folder, _ = prepare(tcfg["dataset"], tcfg["tokenizer"], tcfg["data_dir"])
    val = load_split(folder, "val")
    newline = tok.encode("\n")[0] if tok.kind == "char" else None
    prompts = []
    for start in np.linspace(0, len(val) - length - 1, n + 1, dtype=np.int64)[:n]:
        if newline is not None:  # begin after a newline, so a prompt is whole lines of code or verse
            nl = np.flatnonzero(val[start:start + length] == newline)
            start += int(nl[0]) + 1 if len(nl) else 0
        prompts.append([int(t) for t in val[start:start + length]])
    return prompts


def file_prompts(path, tok):
    out = []
    for i, line in enumerate(open(path, encoding="utf-8"), 1):
        if line.strip():
            try:
                out.append(tok.encode(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UsageError(f'{path}:{i} is not a JSON object with a "prompt" string') from None
    if not out:
        raise UsageError(f"{path} holds no prompts")
    return out


def run_pair(model, prompts, tree, kw):
    """AR and SS on each prompt, interleaved (the order alternates); returns both lists of results."""
    ar, ss = [], []
    for i, p in enumerate(prompts):
        order = (("ar", ar), ("ss", ss)) if i % 2 == 0 else (("ss", ss), ("ar", ar))
        for kind, acc in order:
            acc.append(generate_ar(model, p, **kw) if kind == "ar" else generate_speculative(model, p, tree=tree, **kw))
    return ar, ss


def summarize(ar, ss):
    toks = lambda rs: sum(s.new_tokens for _, s in rs)
    secs = lambda rs: sum(s.seconds for _, s in rs)
    passes = lambda rs: sum(s.passes for _, s in rs)
    accepted = [a for _, s in ss for a in s.accepted]
    ar_tps, ss_tps = toks(ar) / secs(ar), toks(ss) / secs(ss)
    cr = passes(ar) / passes(ss)
    match = [a == b for (a, _), (b, _) in zip(ar, ss)]
    first = next(((i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
                  for i, ((a, _), (b, _)) in enumerate(zip(ar, ss)) if a != b), None)
    hist = {}
    for a in accepted:
        hist[a] = hist.get(a, 0) + 1
    return dict(ar_tokens_per_s=ar_tps, ss_tokens_per_s=ss_tps, speedup=ss_tps / ar_tps,
                mean_accepted=sum(accepted) / len(accepted), call_reduction=cr, efficiency=ss_tps / ar_tps / cr,
                match_rate=sum(match) / len(match), first_divergence=first,
                ar_ms_per_pass=1000 * secs(ar) / passes(ar), ss_ms_per_pass=1000 * secs(ss) / passes(ss),
                accepted_histogram=dict(sorted(hist.items())), new_tokens=toks(ss))


def sweep(model, prompts, candidates, kw, log):
    """tokens/s of SS for each candidate tree (AR measured alongside); returns the rows."""
    rows = []
    for spec in candidates:
        tree = make_tree(spec, model.config.n_streams)
        r = summarize(*run_pair(model, prompts, tree, kw))
        rows.append((spec, len(tree), r))
    best = max(rows, key=lambda row: row[2]["speedup"])
    log(f"{'tree':>8} {'nodes':>5} {'AR tok/s':>9} {'SS tok/s':>9} {'speedup':>8} {'tau':>5} {'CR':>5} {'SS ms/pass':>10}")
    for spec, n, r in rows:
        log(f"{spec:>8} {n:>5} {r['ar_tokens_per_s']:9.0f} {r['ss_tokens_per_s']:9.0f} {r['speedup']:7.2f}x "
            f"{r['mean_accepted']:5.2f} {r['call_reduction']:5.2f} {r['ss_ms_per_pass']:10.2f}"
            + ("  <- best" if (spec, n, r) == best else ""))
    return rows, best[0]


def train_bench(ckpt, device, steps, log):
    """ms/iter of the checkpoint's training config with its streams and with n_streams=0."""
    from ss_mini.model import GPT, GPTConfig
    tcfg = ckpt["config"]
    keys = ("n_layer", "n_head", "n_embd", "block_size", "n_msa_layers", "stream_loss_weight", "bias")
    res = {}
    for g in (ckpt["model_args"]["n_streams"], 0):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{k: tcfg[k] for k in keys}, vocab_size=ckpt["model_args"]["vocab_size"],
                              n_streams=g)).to(device)
        opt = model.configure_optimizer(0.1, 1e-3, (0.9, 0.99), device.split(":")[0])
        x = torch.randint(0, model.config.vocab_size, (tcfg["batch_size"], tcfg["block_size"]), device=device)
        times = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            _, _, losses = model(x, x)
            losses["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res[g] = 1000 * statistics.median(times[2:])
    g = ckpt["model_args"]["n_streams"]
    log(f"training, batch {tcfg['batch_size']} x {tcfg['block_size']}: {res[g]:.0f} ms/iter with {g} streams, "
        f"{res[0]:.0f} ms/iter without ({res[g] / res[0]:.2f}x)")
    return {"train_ms_per_iter_streams": res[g], "train_ms_per_iter_plain": res[0]}


def profile(model, prompts, tree, kw, log):
    """Where the speculative loop spends its time (cProfile; its overhead inflates Python parts)."""
    prof = cProfile.Profile()
    prof.enable()
    for p in prompts:
        generate_speculative(model, p, tree=tree, **kw)
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[3] for k, v in st.stats.items() if k[2] == "generate_speculative")
    parts = {"forward passes, prefill included": ("forward_nodes",), "tree draft": ("draft",),
             "masks": ("tree_mask", "stream_mask", "at"), "target pick (argmax/sample)": ("__call__",),
             "verify walk": ("_walk",), "accept (cache compaction)": ("accept",)}
    log(f"profile of {len(prompts)} speculative generations, {total:.2f} s in generate_speculative:")
    for label, names in parts.items():
        t = sum(v[3] for (f, _, fn), v in st.stats.items() if fn in names and "ss_mini" in f)
        log(f"  {label:<34} {t:7.3f} s  {100 * t / total:5.1f}%")


def main(argv=None):
    cfg = parse_args(config, argv, __doc__, flags=("sweep", "profile", "json"))
    device = pick_device(cfg["device"])
    dtype = pick_dtype(cfg["dtype"], device)
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    log = lambda *a: print(*a, flush=True)
    model, tok, ckpt = load_model(cfg["out_dir"], device, getattr(torch, dtype))
    if model.config.n_streams == 0:
        raise UsageError(f"{cfg['out_dir']} has no speculative streams (n_streams=0): train one with --n_streams=3")
    n_cal = max(2, cfg["num_prompts"] // 3)
    if cfg["prompts"]:
        prompts = file_prompts(cfg["prompts"], tok)
        calibration = prompts[:n_cal]
    else:  # every 4th snippet calibrates tree=auto, so the reported prompts are not the tuned ones
        both = validation_prompts(ckpt, tok, cfg["num_prompts"] + n_cal, cfg["prompt_tokens"])
        calibration = both[3::4][:n_cal]
        prompts = [p for i, p in enumerate(both) if not (i % 4 == 3 and i // 4 < n_cal)][:cfg["num_prompts"]]
    kw = dict(max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"] or None,
              top_p=cfg["top_p"], seed=cfg["seed"], eot=tok.eot)
    base, draft = model.param_counts()
    log(f"model {cfg['out_dir']}: {model.config.n_layer} layers x {model.config.n_embd}, "
        f"gamma={model.config.n_streams}, Ns={model.config.n_msa_layers}; {base:,} base + {draft:,} draft parameters; "
        f"{device} {dtype}, {torch.get_num_threads()} threads")
    run_pair(model, calibration[:1], make_tree("1,1,1", model.config.n_streams),
             {**kw, "max_new_tokens": 32})  # warm-up
    result = {}
    candidates = [c for c in cfg["candidates"].split(";") if c]
    candidates = [c for c in candidates if c.startswith("n") or len(c.split(",")) <= model.config.n_streams]
    spec = cfg["tree"]
    if cfg["sweep"] or spec == "auto":
        cal_kw = {**kw, "max_new_tokens": min(kw["max_new_tokens"], 128)}
        log(f"tree search on {len(calibration)} calibration prompts, {cal_kw['max_new_tokens']} new tokens each:")
        _, best = sweep(model, calibration, candidates, cal_kw, log)
        spec = best if spec == "auto" else spec
    tree = make_tree(spec, model.config.n_streams)
    if cfg["profile"]:
        profile(model, prompts, tree, kw, log)
    r = summarize(*run_pair(model, prompts, tree, kw))
    mode = "greedy" if cfg["temperature"] == 0 else f"sampling, temperature {cfg['temperature']}"
    log(f"\n{len(prompts)} prompts x {kw['max_new_tokens']} new tokens, {mode}, tree {tree} ({len(tree)} nodes):")
    log(f"  {'':24} {'autoregressive':>15} {'speculative':>12}")
    log(f"  {'tokens/s':24} {r['ar_tokens_per_s']:15.1f} {r['ss_tokens_per_s']:12.1f}")
    log(f"  {'ms per forward pass':24} {r['ar_ms_per_pass']:15.2f} {r['ss_ms_per_pass']:12.2f}")
    log(f"  speedup {r['speedup']:.2f}x | mean accepted tokens per pass (root included) {r['mean_accepted']:.2f} | "
        f"call-reduction {r['call_reduction']:.2f} | efficiency {r['efficiency']:.2f}")
    log(f"  accepted-length histogram: {r['accepted_histogram']}")
    if cfg["temperature"] == 0:
        div = r["first_divergence"]
        log(f"  greedy outputs identical on {100 * r['match_rate']:.0f}% of prompts"
            + (f"; first divergence: prompt {div[0]}, token {div[1]}" if div else ""))
    log(f"  draft parameters {draft:,} vs base parameters {base:,} ({draft / base:.1e})")
    if cfg["train_steps"]:
        result.update(train_bench(ckpt, device, cfg["train_steps"], log))
    result.update(r, tree=str(tree), tree_nodes=len(tree), draft_params=draft, base_params=base, device=device,
                  dtype=dtype, threads=torch.get_num_threads(), prompts=len(prompts),
                  max_new_tokens=kw["max_new_tokens"], temperature=cfg["temperature"])
    if cfg["json"]:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        sys.exit(f"error: {e}")
