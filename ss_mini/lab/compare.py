"""`python bench.py --compare=dirA,dirB,...`: the analogue of the paper's Table 1 for models
fine-tuned from one base on one dataset: each one's drafter, its parameters, its held-out loss,
its tokens/s and its speedup over plain decoding (docs/table1.md)."""
import numpy as np
import torch

from ..baseline import generate_ar
from ..io.checkpoint import load_model, param_counts, training_data
from ..io.cli import UsageError
from ..io.data import load_split
from .measure import repeat_rate, run_pair, summarize, tree_spec
from .tree_choice import choose_tree, decode_kwargs, pick_prompts


def describe(config):
    if config.n_streams:
        return f"streams (gamma={config.n_streams}, Ns={config.n_msa_layers})"
    return f"Medusa (K={config.n_medusa_heads})" if config.n_medusa_heads else "none"


@torch.no_grad()
def val_loss(model, ckpt, windows=64):
    """Main-stream loss on the same evenly spaced windows of the held-out split."""
    T = model.config.block_size
    folder, _ = training_data(ckpt)
    val = load_split(folder, "val")
    starts = np.linspace(0, len(val) - T - 2, windows, dtype=np.int64)
    data = torch.from_numpy(np.stack([val[i:i + T + 1] for i in starts]).astype(np.int64))
    data = data.to(model.lm_head.weight.device)
    losses = [model(b[:, :-1], b[:, 1:])[2]["main"].item() for b in data.split(16)]
    return sum(losses) / len(losses)


def compare(dirs, cfg, device, dtype, log):
    """The analogue of the paper's Table 1, for models fine-tuned from one base on one dataset."""
    rows, first = [], None
    for d in dirs:
        model, tok, ckpt = load_model(d, device, dtype, cfg["lean"])
        if first is None:
            first = (tok.meta(), ckpt["config"]["dataset"])
            prompts, calibration = pick_prompts(cfg, ckpt, tok)
            kw = decode_kwargs(cfg, tok)
        elif (tok.meta(), ckpt["config"]["dataset"]) != first:
            raise UsageError(f"{d} was trained on other data than {dirs[0]}: compare models of "
                             "one dataset")
        base, draft = param_counts(model)
        row = dict(model=d, drafter=describe(model.config), draft_params=draft, base_params=base,
                   val_loss=val_loss(model, ckpt))
        if model.config.n_drafts:
            tree = choose_tree(model, calibration, cfg, kw, lambda *a: None)  # and its warm-up
            row.update(summarize(*run_pair(model, prompts, tree, kw)), tree=tree_spec(tree))
        else:
            generate_ar(model, calibration[0], **{**kw, "max_new_tokens": 32})  # warm-up
            outs = [generate_ar(model, p, **kw) for p in prompts]
            row["ar_tokens_per_s"] = (sum(s.new_tokens for _, s in outs)
                                      / sum(s.seconds for _, s in outs))
            row["repeat_rate"] = repeat_rate([o for o, _ in outs])
        rows.append(row)
    log_comparison(rows, len(prompts), kw["max_new_tokens"], first[1], device, dtype, log)
    return rows


def log_comparison(rows, n, max_new_tokens, dataset, device, dtype, log):
    """compare's table; same: the share of prompts whose outputs equal autoregressive decoding's."""
    log(f"\n{n} prompts x {max_new_tokens} new tokens, {dataset} ({device} {dtype}):")
    log(f"{'model':<22} {'drafter':<26} {'draft params':>12} {'val loss':>8} {'AR tok/s':>8} "
        f"{'speedup':>8} {'repeats':>7} {'CR':>5} {'tau':>5} {'tree':>7} {'same':>5}")
    for r in rows:
        spd = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        extra = (f"{r['call_reduction']:5.2f} {r['mean_accepted']:5.2f} {r['tree']:>7} "
                 f"{r['match_rate']:5.0%}" if "speedup" in r else "")
        log(f"{r['model']:<22} {r['drafter']:<26} {r['draft_params']:>12,} {r['val_loss']:8.4f} "
            f"{r['ar_tokens_per_s']:8.0f} {spd:>8} {r['repeat_rate']:7.0%} {extra}")
