"""Where a training run starts (train.py): its flags checked against their meanings and against
what is on disk, before any work; the checkpoint it starts from, if any."""
import os

import torch

from ..model import GPTConfig
from .checkpoint import load_checkpoint
from .cli import UsageError, check
from .nanogpt import import_nanogpt
from .pretrained import find_gpt2_files

# train.py's flags that make the model (its vocabulary comes from the tokenizer)
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "n_streams",
              "n_msa_layers", "stream_loss_weight", "stream_targets", "stream_stride",
              "stream_adapter_rank", "n_medusa_heads", "prune_adapter_rank")


def make_optimizer(model, weight_decay, learning_rate, betas, device_type):
    """AdamW over the trainable parameters; biases, norms and the stream embeddings P do not
    decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    no_decay = [p for p in params if p.dim() < 2 or p is getattr(model, "stream_emb", None)]
    decay = [p for p in params if p.dim() >= 2 and all(p is not q for q in no_decay)]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def check_config(cfg, given, rules):
    """Every flag against its meaning, and the run against what is on disk, before any work:
    a fresh run never replaces a checkpoint unless --overwrite=True says so; a resumed run
    takes its data, tokenizer and model from the checkpoint, and a flag that contradicts
    them is an error. rules: train.py's flag rules (io/cli.py `check`). Returns the checkpoint
    to start from (to resume, to fine-tune, or nanoGPT's, imported), or None."""
    check_flags(cfg, rules)
    ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
    if cfg["init_from"] != "resume":
        return fresh_start(cfg, given, ckpt_path)
    return resumed_start(cfg, given, ckpt_path)


def check_flags(cfg, rules):
    """The flags against their meanings and each other (and GPT-2's weights: they exist)."""
    check(cfg, rules)
    if cfg["min_lr"] > cfg["learning_rate"]:
        raise UsageError(f"--min_lr={cfg['min_lr']} is above "
                         f"--learning_rate={cfg['learning_rate']}")
    g = max(cfg["n_streams"], cfg["n_medusa_heads"])
    k = cfg["stream_stride"] if g else 1
    if cfg["block_size"] < g + k + 1:  # the last stream needs a target at every offset
        raise UsageError(f"--block_size={cfg['block_size']} leaves stream {g} no target: use a "
                         f"block_size of at least the number of streams + stream_stride + 1 = "
                         f"{g + k + 1}")
    if cfg["init_from"] == "scratch":  # its own checks (heads divide the width, Ns <= layers, ...)
        GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})
    if cfg["init_from"].startswith("gpt2:"):
        if cfg["tokenizer"] != "gpt2":
            raise UsageError("--init_from=gpt2:... needs --tokenizer=gpt2 (GPT-2's own BPE)")
        find_gpt2_files(cfg["init_from"][5:])  # the weights exist before a dataset is tokenised
    if cfg["meta_pkl"] and not cfg["init_from"].startswith("nanogpt:"):
        raise UsageError("--meta_pkl is the vocabulary of a nanoGPT checkpoint: give it with "
                         "--init_from=nanogpt:PATH")


def fresh_start(cfg, given, ckpt_path):
    """A run that starts anew: the checkpoint it starts from (nanoGPT's, imported, or one to
    fine-tune), or None (scratch, GPT-2's weights)."""
    if os.path.exists(ckpt_path) and not cfg["overwrite"]:
        raise UsageError(f"{ckpt_path} exists: continue it with --init_from=resume, write "
                         "elsewhere with --out_dir=DIR, or replace it with --overwrite=True")
    if cfg["init_from"].startswith("nanogpt:"):
        # its weights, and its vocabulary: the dataset is encoded with nanoGPT's ids
        source = import_nanogpt(cfg["init_from"][8:], cfg["dataset"], cfg["meta_pkl"],
                                cfg["block_size"] if "block_size" in given else None)
        kind = source["tokenizer"]["tokenizer"]
        if "tokenizer" in given and cfg["tokenizer"] != kind:
            raise UsageError(f"--tokenizer={cfg['tokenizer']} contradicts {source['source']}, "
                             f"which uses {source['meta_pkl'] or 'GPT-2 BPE'}: drop the flag")
        cfg["tokenizer"], cfg["meta_pkl"] = kind, source["meta_pkl"]
        return source
    if cfg["init_from"] == "scratch" or cfg["init_from"].startswith("gpt2:"):
        return None
    source = load_checkpoint(cfg["init_from"])
    # a model imported from nanoGPT keeps its vocabulary
    cfg["meta_pkl"] = source.get("config", {}).get("meta_pkl", "")
    return source


def resumed_start(cfg, given, ckpt_path):
    """The checkpoint a resumed run continues; its data, tokenizer and model become the run's."""
    ckpt = load_checkpoint(ckpt_path)
    saved = {**ckpt["config"], **ckpt["model_args"]}
    for key in ("dataset", "tokenizer", "meta_pkl") + MODEL_KEYS:
        if key in given and cfg[key] != saved.get(key, cfg[key]):
            raise UsageError(f"--{key}={cfg[key]!r} contradicts {ckpt_path}, trained with "
                             f"{key}={saved[key]!r}: drop the flag to resume, or train a new "
                             "model in another --out_dir")
        cfg[key] = saved.get(key, cfg[key])
    if "data_dir" not in given:
        cfg["data_dir"] = ckpt["config"].get("data_dir", cfg["data_dir"])
    if ckpt["iter_num"] >= cfg["max_iters"]:
        raise UsageError(f"{ckpt_path} is at iteration {ckpt['iter_num']}: give --max_iters "
                         "above it to train on")
    return ckpt
