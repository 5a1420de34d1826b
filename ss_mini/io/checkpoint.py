"""Checkpoints: written atomically, read with weights_only=True.

A checkpoint holds only tensors and plain Python types (model config, weights,
optimizer state, iteration, best val loss, training config, tokenizer metadata), so
`torch.load(..., weights_only=True)` reads it and a checkpoint from elsewhere cannot
run code. It is written to a temporary file in the same folder and then moved over
the old one with os.replace, so an interrupted save never leaves a broken file.
"""
import os
from dataclasses import asdict, fields

import torch

from .data import Tokenizer, prepare
from ..extras import build_model
from ..extras.kernels import make_lean
from ..model import GPTConfig
from .nanogpt import looks_like_nanogpt


def save_checkpoint(ckpt, path):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        torch.save(ckpt, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, map_location="cpu"):
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}: run python train.py first (or pass "
                                "--out_dir)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise RuntimeError(f"{path} is not a readable ss_mini checkpoint ({type(e).__name__}); "
                           "retrain it or point to another one") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise RuntimeError(f"{path} is not an ss_mini checkpoint (no model/model_args); retrain it "
                           "or point to another one")
    if looks_like_nanogpt(ckpt):
        raise RuntimeError(f"{path} is a nanoGPT checkpoint: add streams to it with python "
                           f"train.py --init_from=nanogpt:{path} --dataset=text:PATH (its training "
                           "text), then use that out_dir")
    return ckpt


def model_config(model_args):
    known = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in model_args.items() if k in known})


def make_checkpoint(model, **extra):
    """Weights of the uncompiled module (no `_orig_mod.` prefixes) plus plain-typed metadata."""
    raw = getattr(model, "_orig_mod", model)
    raw = getattr(raw, "module", raw)  # DistributedDataParallel
    return {"model": raw.state_dict(), "model_args": asdict(raw.config), **extra}


def is_draft_param(name):
    """Parameters that exist only for drafting: stream embeddings P, stream adapters, Medusa
    heads, the pruning adapter (the paper's "extra parameters")."""
    return (name == "stream_emb" or ".stream_adapter." in name
            or name.startswith(("medusa_heads.", "prune_adapter.")))


def param_counts(model):
    """(base, draft) parameter counts."""
    draft = sum(p.numel() for n, p in model.named_parameters() if is_draft_param(n))
    return sum(p.numel() for p in model.parameters()) - draft, draft


def load_model(path, device="cpu", dtype=torch.float32, lean=False):
    """(model in eval mode, tokenizer, checkpoint) from an out_dir or a ckpt.pt path. lean: the
    eager CPU path (extras/kernels.py `make_lean`), else the method's own classes."""
    ckpt = load_checkpoint(path)
    model = build_model(model_config(ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.to(device=device, dtype=dtype).eval()
    return make_lean(model) if lean else model, Tokenizer(ckpt["tokenizer"]), ckpt


def training_data(ckpt):
    """(folder, meta) of the tokenised dataset a checkpoint was trained on, prepared as train.py
    did."""
    tcfg = ckpt["config"]
    # nanoGPT's vocabulary, not the dataset's
    chars = ckpt["tokenizer"].get("chars") if tcfg.get("meta_pkl") else None
    return prepare(tcfg["dataset"], tcfg["tokenizer"], tcfg["data_dir"], chars)
