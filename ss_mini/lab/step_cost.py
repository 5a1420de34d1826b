"""What one speculative step costs, and where its time goes: a cProfile split of whole decodes
(`bench.py --profile`), a step over n nodes in autoregressive steps with its bandwidth
(`bench.py --pass_cost`), and the bytes a step reads against this machine's copy bandwidth
(the report's roofline line, "the roof: ..."); and what a training step costs with the drafter
and without (`bench.py --train_steps`)."""
import cProfile
import dataclasses
import pstats
import statistics
import sys
import time

import torch

from ..extras import build_model
from ..extras.kernels import make_lean
from ..generate import generate_speculative
from ..io.checkpoint import load_model, model_config
from ..io.cli import UsageError
from ..io.run_start import make_optimizer
from ..model import GPTConfig
from .compare import describe
from .measure import copy_bandwidth, pass_cost, step_bytes, synchronize, threads
from .tree_choice import validation_prompts


def profile(model, prompts, tree, kw, log):
    """Where the speculative loop spends its time (cProfile; its overhead inflates Python parts)."""
    prof = cProfile.Profile()
    prof.enable()
    for p in prompts:
        generate_speculative(model, p, tree=tree, **kw)
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[3] for k, v in st.stats.items() if k[2] == "generate_speculative")

    def seconds(names, own=False):
        """Time in ss_mini's functions of these names, with what they call (own=True: their own
        Python only); a call from another of them is not counted twice."""
        t = 0.0
        for (f, _, fn), (_, _, tt, ct, callers) in st.stats.items():
            if fn in names and "ss_mini" in f:
                t += tt if own else ct - sum(c[3] for (_, _, caller), c in callers.items()
                                             if caller in names)
        return t
    parts = {
        "forward passes, prefill and window rebuilds included":
            seconds(("forward_nodes", "pruned_forward")),
        "tree draft (candidates ranked, the tree's shape)": seconds(("draft", "shape")),
        "drafts from the text (the lookup on the host)": seconds(("lookup", "look")),
        "masks (each row's window over the cache)": seconds(("mask",)),
        "verify (the target's tokens)": seconds(("verify", "pick")),
        "accept (cache compaction, lengths)": seconds(("accept", "advance")),
        "the decoder's rows (their tokens, Python only)":
            seconds(("emit", "join", "_fill", "finish"), own=True)}
    log(f"profile of {len(prompts)} speculative generations, {total:.2f} s in "
        "generate_speculative:")
    for label, t in parts.items():
        log(f"  {label:<52} {t:7.3f} s  {100 * t / total:5.1f}%")


def cost_model(cfg, device, dtype):
    """--pass_cost's model: (model, context of half the block (at most 256 tokens), its name),
    the checkpoint's or a random model of --shape."""
    if not cfg["shape"]:
        model, tok, ckpt = load_model(cfg["out_dir"], device, dtype, cfg["lean"])
        if model.config.n_drafts == 0:
            raise UsageError(f"{cfg['out_dir']} has no drafter (n_streams=0): train one with "
                             "--n_streams=3")
        context = validation_prompts(ckpt, tok, 1, min(model.config.block_size // 2, 256))[0]
        return model, context, cfg["out_dir"]
    try:
        n_layer, n_head, n_embd, vocab = (int(v) for v in cfg["shape"].split(","))
        config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab,
                           block_size=1024, n_streams=3, n_msa_layers=min(2, n_layer))
    except ValueError as e:
        raise UsageError(f"--shape={cfg['shape']}: give N_LAYER,N_HEAD,N_EMBD,VOCAB, e.g. "
                         f"12,12,768,50257 ({e})") from None
    torch.manual_seed(0)
    model = build_model(config).to(device=device, dtype=dtype).eval()
    model = make_lean(model) if cfg["lean"] else model
    context = torch.randint(0, vocab, (min(config.block_size // 2, 256),)).tolist()
    return model, context, f"random model {cfg['shape']}"


def step_costs(cfg, device, dtype, log):
    """--pass_cost: one whole speculative step over budget trees of n nodes (n = 4 is the top-1
    chain for gamma = 3) against one autoregressive step, with a KV cache of half the block
    (at most 256 tokens), on the checkpoint or on a random model of --shape."""
    model, context, name = cost_model(cfg, device, dtype)
    c = model.config
    B = cfg["batch_size"]
    sampling = dict(temperature=cfg["temperature"], top_k=cfg["top_k"] or None, top_p=cfg["top_p"])
    costs, floors, ar_ms = pass_cost(model, context, batch_size=B, **sampling)
    log(f"{name}: {c.n_layer} layers x {c.n_embd}, vocabulary {c.vocab_size}, {describe(c)}, "
        f"{device} {str(dtype)[6:]}, {threads()}; KV cache of {len(context)} tokens"
        + (f"; a batch of {B} rows" if B > 1 else "")
        + (f"; both steps sample at temperature {cfg['temperature']:g}" if cfg["temperature"]
           else ""))
    log(f"one autoregressive step: {ar_ms:.3f} ms (median); one speculative step over a tree of "
        "n nodes, in autoregressive steps:")
    log("  " + "  ".join(f"n={n}: {r:.2f}x" for n, r in costs.items()))
    log("the floor under it: what the tree pass's extra matrix-product rows alone cost, in "
        "autoregressive steps, plus 1:")
    log("  " + "  ".join(f"n={n}: {r:.2f}x" for n, r in floors.items()))
    ratios = list(costs.values())
    # a step 3% cheaper than one over fewer nodes is beyond the timing's noise
    if min(ratios) < 0.97 or any(b < 0.97 * a for a, b in zip(ratios, ratios[1:])):
        print("warning: a step over more nodes costs less than one over fewer (or than the "
              "autoregressive step): the baseline is slower than the tree pass, its kernels are "
              "not comparable (see ss_mini/extras/kernels.py)", file=sys.stderr, flush=True)
    result = {"pass_cost": {str(n): r for n, r in costs.items()},
              "pass_cost_floor": {str(n): r for n, r in floors.items()},
              "ar_ms_per_step": ar_ms, "cache_tokens": len(context)}
    result.update(bandwidth(model, len(context), B, device, dtype, costs, ar_ms, log))
    if cfg["compile"]:
        costs, _, ar_ms = pass_cost(model, context, batch_size=B, compiled=True, **sampling)
        log(f"with torch.compile: one autoregressive step {ar_ms:.3f} ms; speculative steps in "
            "compiled autoregressive steps:\n  "
            + "  ".join(f"n={n}: {r:.2f}x" for n, r in costs.items()))
        result["compiled"] = {"pass_cost": {str(n): r for n, r in costs.items()},
                              "ar_ms_per_step": ar_ms}
    return result


def bandwidth(model, cache_len, B, device, dtype, costs, ar_ms, log):
    """--pass_cost's memory-bandwidth view: every step reads all weights and the KV cache once,
    whatever its node count."""
    nbytes, roof = step_bytes(model, cache_len, B), copy_bandwidth(device, dtype)
    log(f"bandwidth: a step reads {nbytes / 1e6:.1f} MB (weights and KV cache); this machine "
        f"copies at {roof / 1e9:.1f} GB/s; the autoregressive step runs at "
        f"{nbytes / ar_ms / 1e6:.1f} GB/s, {100 * nbytes / ar_ms * 1e3 / roof:.0f}% of it; a "
        "step over n nodes, for the same bytes:")
    log("  " + "  ".join(f"n={n}: {nbytes / (r * ar_ms) / 1e6:.1f} GB/s" for n, r in costs.items()))
    return {"step_bytes": nbytes, "copy_bandwidth_gb_s": roof / 1e9,
            "ar_bandwidth_utilisation": nbytes / ar_ms * 1e3 / roof}


def roofline(model, rows, device, dtype, ms_per_pass):
    """How far each decoding step is from the memory roof: the bytes a step must read (weights
    once, each row's KV cache at three quarters of the block, the mean over a sliding window)
    per second against this machine's copy bandwidth: model bandwidth utilisation, as
    gpt-fast reports it. A step bound by Python and kernel launches sits far below the roof."""
    nbytes = step_bytes(model, model.config.block_size * 3 // 4, rows)
    roof = copy_bandwidth(device, getattr(torch, dtype))
    use = {name: nbytes / (ms / 1e3) / roof for name, ms in ms_per_pass.items()}
    line = (f"  the roof: a step reads {nbytes / 1e6:.1f} MB and this machine copies "
            f"{roof / 1e9:.1f} GB/s; "
            + ", ".join(f"{name} steps run at {nbytes / (ms / 1e3) / 1e9:.2f} GB/s "
                        f"({use[name]:.0%} of it)" for name, ms in ms_per_pass.items()))
    return dict(step_bytes=nbytes, copy_bandwidth_gb_s=roof / 1e9, bandwidth_utilisation=use,
                line=line)


def train_bench(ckpt, device, steps, log):
    """ms/iter of the checkpoint's training config with its drafter and without (plain GPT)."""
    tcfg, res = ckpt["config"], {}
    for name in ("drafter", "plain"):
        config = model_config(ckpt["model_args"])
        if name == "plain":  # a new config, so that GPTConfig checks it
            config = dataclasses.replace(config, n_streams=0, n_medusa_heads=0,
                                         prune_adapter_rank=0)
        torch.manual_seed(0)
        model = build_model(config).to(device)
        opt = make_optimizer(model, 0.1, 1e-3, (0.9, 0.99), device.split(":")[0])
        x = torch.randint(0, config.vocab_size, (tcfg["batch_size"], config.block_size),
                          device=device)
        times = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            _, _, losses = model(x, x)
            losses["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        res[name] = 1000 * statistics.median(times[2:])
    log(f"training, batch {tcfg['batch_size']} x {tcfg['block_size']}: {res['drafter']:.0f} "
        f"ms/iter with the drafter, {res['plain']:.0f} ms/iter without "
        f"({res['drafter'] / res['plain']:.2f}x)")
    return {"train_ms_per_iter_streams": res["drafter"], "train_ms_per_iter_plain": res["plain"]}
