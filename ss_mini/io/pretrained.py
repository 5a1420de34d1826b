"""Hugging Face GPT-2 checkpoints (gpt2, gpt2-medium, ...) from local files.

The main stream is GPT-2, so its weights load unchanged; only HF's Conv1D matrices
are stored transposed. Streams (and stream adapters) start fresh. Nothing is
downloaded: `spec` is a model folder (config.json + model.safetensors or
pytorch_model.bin), a weights file with config.json beside it, or a hub name
("gpt2") found in the local Hugging Face cache.
"""
import glob
import json
import os

import torch

from ..extras import build_model
from ..model import GPTConfig
from .checkpoint import is_draft_param

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _hf_cache_dirs():
    """Where Hugging Face keeps downloaded models (its own conventions, HF_HUB_CACHE / HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return [os.environ["HF_HUB_CACHE"]]
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return [os.path.join(home, "hub")]


def find_gpt2_files(spec):
    """(config.json path, weights path) for a folder, a weights file, or a cached hub name."""
    looked = []
    if os.path.isfile(spec):
        files = [spec]
    elif os.path.isdir(spec):
        files = [os.path.join(spec, w) for w in WEIGHT_FILES]
    else:
        name = "models--" + spec.replace("/", "--")
        snapshots = [f for d in _hf_cache_dirs()
                     for f in sorted(glob.glob(os.path.join(d, name, "snapshots", "*")))]
        looked += [os.path.join(d, name) for d in _hf_cache_dirs()]
        files = [os.path.join(f, w) for f in snapshots for w in WEIGHT_FILES]
    for w in files:
        cfg = os.path.join(os.path.dirname(w), "config.json")
        looked.append(w)
        if os.path.isfile(w) and os.path.isfile(cfg):
            return cfg, w
    raise FileNotFoundError(
        f"no GPT-2 weights (config.json + {' or '.join(WEIGHT_FILES)}) for {spec!r}; looked at: "
        f"{', '.join(looked)}. Get them on a machine with internet (huggingface-cli download gpt2 "
        "config.json model.safetensors --local-dir DIR) and pass DIR")


def read_state_dict(path):
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise RuntimeError(f"{path} is safetensors: pip install safetensors (or pip install "
                               "-e \".[gpt2]\")") from None
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def crop_block_size(model, block_size):
    """Keep only the first block_size learned positions (e.g. GPT-2's 1024 -> 128)."""
    assert block_size <= model.config.block_size
    model.config.block_size = block_size
    wpe = model.transformer.wpe.weight[:block_size].detach().clone()
    model.transformer.wpe.weight = torch.nn.Parameter(wpe)


def load_gpt2(spec, **stream_args):
    """A GPT with GPT-2's weights; stream_args (n_streams, n_msa_layers, ...) add streams."""
    cfg_path, weights = find_gpt2_files(spec)
    hf = json.load(open(cfg_path))
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{cfg_path} describes a {hf.get('model_type')!r} model, not GPT-2")
    config = GPTConfig(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                       block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
                       vocab_size=hf["vocab_size"], bias=True,
                       **{"dropout": 0.0, "n_streams": 0, **stream_args})
    model = build_model(config)
    ours = model.state_dict()
    loaded = set()
    for key, value in read_state_dict(weights).items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers; the head is tied to wte
        name = "transformer." + key
        if name not in ours:
            raise RuntimeError(f"{weights} has a weight {key!r} that GPT-2 does not: is it a GPT-2 "
                               "checkpoint?")
        value = value.t() if key.endswith(TRANSPOSED) else value
        if value.shape != ours[name].shape:
            raise RuntimeError(f"{weights}: {key} has shape {tuple(value.shape)}, expected "
                               f"{tuple(ours[name].shape)}")
        with torch.no_grad():
            ours[name].copy_(value)
        loaded.add(name)
    missing = [k for k in ours if k not in loaded and k.startswith("transformer.")
               and not is_draft_param(k)]
    if missing:
        raise RuntimeError(f"{weights} lacks {len(missing)} GPT-2 weights, e.g. {missing[0]}")
    return model
