"""Import a checkpoint written by nanoGPT's train.py (github.com/karpathy/nanoGPT).

nanoGPT's GPT is GPT-2, and so is the main stream here, with one difference that decides
exactness: nanoGPT's MLP uses nn.GELU(), the exact erf form, where GPT-2 (and ss_mini's
default) use the tanh approximation. The two differ in the last digits of every
activation, enough to move logits past 1e-5 and, over a long continuation, to flip a
greedy argmax, so an imported model runs with gelu_approximate="none". Everything else is
the same, module for module and name for name, so the weights load without renaming:
pre-LayerNorm blocks with LayerNorm eps 1e-5 and biases in LayerNorm and Linear only when
`bias` is True (nanoGPT's default is False), attention scaled by 1/sqrt(head size), dropout
on the embeddings, the attention weights and both residual branches, learned position
embeddings (wpe), and an LM head without bias, tied to the token embeddings (wte).

What nanoGPT's train.py writes: {'model', 'optimizer', 'model_args', 'iter_num',
'best_val_loss', 'config'}; with compile=True every weight name starts with `_orig_mod.`
(the compiled wrapper's state dict), and on a torch without scaled_dot_product_attention
each block holds its causal mask as a buffer `attn.bias`. Only tensors and plain types:
it is read with torch.load(weights_only=True), so a checkpoint cannot run code.

Its vocabulary, as nanoGPT's sample.py finds it: the char vocabulary of meta.pkl
({'vocab_size', 'itos', 'stoi'}, written by data/<dataset>/prepare.py), else GPT-2's BPE.
meta.pkl is a pickle, and unpickling calls whatever the file names; it is read with an
unpickler whose find_class refuses every name, so only containers and literals load, and
then it must hold dicts, lists, strings and ints, nothing else.
"""
import os
import pickle
from dataclasses import asdict

import torch

from ..extras import build_model
from ..model import GPTConfig

# nanoGPT's model_args
ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")
PREFIX = "_orig_mod."  # torch.compile's wrapper
# GPT-2's BPE; nanoGPT pads the vocabulary of a model trained from scratch to 50304
GPT2_VOCAB = 50257


def looks_like_nanogpt(ckpt):
    """A nanoGPT checkpoint: model_args without any of ss_mini's stream fields."""
    args = ckpt.get("model_args") if isinstance(ckpt, dict) else None
    return (isinstance(args, dict) and "n_layer" in args and "n_streams" not in args
            and "tokenizer" not in ckpt)


class PlainUnpickler(pickle.Unpickler):
    """Refuses every class and function a pickle names: what loads is built by pickle's own
    opcodes (dicts, lists, strings, numbers, ...), never by calling code from the file."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and only plain data is read")


def is_plain(obj):
    """Only dicts, lists, strings and ints, however nested (and never looping forever on a
    list that holds itself)."""
    stack, seen = [obj], set()
    while stack:
        x = stack.pop()
        if type(x) in (dict, list):
            if id(x) in seen:
                continue
            seen.add(id(x))
            stack.extend([*x.keys(), *x.values()] if type(x) is dict else x)
        elif type(x) not in (str, int):
            return False
    return True


def read_meta(path):
    """The characters of a nanoGPT meta.pkl in id order (chars[i] = itos[i])."""
    fix = "regenerate it with nanoGPT's data/<dataset>/prepare.py or give another --meta_pkl"
    try:
        with open(path, "rb") as f:
            meta = PlainUnpickler(f).load()
    except Exception as e:  # a pickle can fail in many ways; none of them may run code
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not plain data as nanoGPT's prepare.py writes it ({why}); "
                         f"{fix}") from None
    if type(meta) is not dict or not is_plain(meta):
        raise ValueError(f"{path} holds other things than dicts, lists, strings and ints; {fix}")
    itos, size = meta.get("itos"), meta.get("vocab_size")
    if type(size) is not int or type(itos) is not dict or set(itos) != set(range(size)):
        raise ValueError(f"{path} has no vocab_size and itos of ids 0..vocab_size-1, as nanoGPT's "
                         f"char-level meta.pkl has; {fix}")
    chars = [itos[i] for i in range(size)]
    if any(type(c) is not str or len(c) != 1 for c in chars) or len(set(chars)) != size:
        raise ValueError(f"{path}: itos must map every id to a distinct single character (a "
                         f"char-level vocabulary); {fix}")
    if "stoi" in meta and meta["stoi"] != {c: i for i, c in enumerate(chars)}:
        raise ValueError(f"{path}: stoi is not the inverse of itos; {fix}")
    return "".join(chars)


def find_meta(ckpt_path, ckpt, dataset, meta_pkl=""):
    """(meta.pkl path or "" for GPT-2's BPE, the paths looked at): the one given, else the one
    beside the dataset's text, else nanoGPT's data/<dataset>/ beside the checkpoint's out_dir."""
    if meta_pkl:
        return meta_pkl, [meta_pkl]
    looked = []
    if dataset.startswith("text:"):
        looked.append(os.path.join(os.path.dirname(os.path.abspath(dataset[5:])), "meta.pkl"))
    name = ckpt["config"].get("dataset") if isinstance(ckpt.get("config"), dict) else None
    if isinstance(name, str) and name:
        # nanoGPT/out-.../ckpt.pt -> nanoGPT
        root = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_path)))
        looked.append(os.path.join(root, "data", name, "meta.pkl"))
    return next((p for p in looked if os.path.isfile(p)), ""), looked


def read_checkpoint(spec):
    """(path, checkpoint) of nanoGPT's out_dir or ckpt.pt, checked to be what its train.py
    writes."""
    path = os.path.join(spec, "ckpt.pt") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--init_from=nanogpt:{spec}: no file {path}; give nanoGPT's "
                                "out_dir (e.g. ../nanoGPT/out-shakespeare-char) or its ckpt.pt")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"{path} is not a checkpoint that torch.load(weights_only=True) reads "
                           f"({why}); give the ckpt.pt that nanoGPT's train.py wrote") from None
    if (not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict)
            or not isinstance(ckpt.get("model_args"), dict)):
        raise RuntimeError(f"{path} is not a nanoGPT checkpoint (no 'model' and 'model_args'); "
                           "give the ckpt.pt that nanoGPT's train.py wrote")
    if not looks_like_nanogpt(ckpt) and "n_streams" in ckpt["model_args"]:
        raise RuntimeError(f"{path} is an ss_mini checkpoint, not nanoGPT's: fine-tune it with "
                           f"--init_from={path}")
    args = ckpt["model_args"]
    missing = [k for k in ARGS if k not in args and k != "dropout"]
    if missing:
        raise RuntimeError(f"{path} is not a nanoGPT checkpoint: its model_args lack "
                           f"{', '.join(missing)}")
    extra = sorted(k for k in args if k not in ARGS)
    if extra:
        raise RuntimeError(f"{path} has model_args {', '.join(extra)}, which karpathy/nanoGPT's "
                           "GPT does not: a modified nanoGPT, whose model this import would not "
                           "reproduce exactly")
    return path, ckpt


def import_nanogpt(spec, dataset="", meta_pkl="", block_size=None):
    """nanoGPT's model as ss_mini checkpoint fields: model_args (a GPTConfig without a drafter
    yet, exact GELU), the weights under ss_mini's names, the tokenizer meta, and meta_pkl
    (the vocabulary's file, "" for GPT-2's BPE). block_size: keep only that many positions,
    as nanoGPT's train.py crops a longer model (short contexts train faster)."""
    path, ckpt = read_checkpoint(spec)
    a = ckpt["model_args"]
    try:
        config = GPTConfig(n_layer=int(a["n_layer"]), n_head=int(a["n_head"]),
                           n_embd=int(a["n_embd"]), block_size=int(a["block_size"]),
                           vocab_size=int(a["vocab_size"]), bias=bool(a["bias"]),
                           dropout=float(a.get("dropout", 0.0)), n_streams=0,
                           gelu_approximate="none")
    except (TypeError, ValueError) as e:
        raise RuntimeError(f"{path}: model_args {dict(a)} do not describe a GPT ({e})") from None
    state = nanogpt_state(path, ckpt, config)
    if block_size and block_size < config.block_size:
        config.block_size = block_size
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:block_size]
    found, looked = find_meta(path, ckpt, dataset, meta_pkl)
    if found:
        chars = read_meta(found)
        if len(chars) != config.vocab_size:
            raise ValueError(f"{found} has {len(chars)} characters but {path} a vocabulary of "
                             f"{config.vocab_size}: give --meta_pkl=PATH of the meta.pkl of the "
                             "dataset nanoGPT trained it on")
        tokenizer = {"tokenizer": "char", "chars": chars}
    elif config.vocab_size >= GPT2_VOCAB:
        tokenizer = {"tokenizer": "gpt2"}
    else:
        raise FileNotFoundError(f"{path} has a vocabulary of {config.vocab_size} (char level?) and "
                                f"there is no meta.pkl at {' or '.join(looked) or 'the dataset'}: "
                                "give --meta_pkl=PATH of the meta.pkl nanoGPT's prepare.py wrote "
                                "for its dataset")
    return {"model": state, "model_args": asdict(config), "tokenizer": tokenizer,
            "meta_pkl": os.path.abspath(found) if found else "", "source": path, "config": {}}


def nanogpt_state(path, ckpt, config):
    """The checkpoint's weights under ss_mini's names, checked to be exactly those of
    nanoGPT's GPT of this config, with wte and lm_head tied."""
    state = {}
    for key, value in ckpt["model"].items():
        key = key.removeprefix(PREFIX)
        # the causal mask of nanoGPT's slow attention path, not a weight
        if not key.endswith(".attn.bias"):
            state[key] = value
    with torch.device("meta"):  # the names and shapes only: nothing is allocated or initialised
        ours = {k: v.shape for k, v in build_model(config).state_dict().items()}
    unexpected = sorted(set(state) - set(ours))
    missing = sorted(set(ours) - set(state))
    if unexpected or missing:
        raise RuntimeError(f"{path} does not hold nanoGPT's GPT: " + "; ".join(
            f"{what} {', '.join(keys[:3])}"
            + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            for what, keys in (("unexpected", unexpected), ("missing", missing)) if keys))
    for key, value in state.items():
        if not torch.is_tensor(value) or value.shape != ours[key]:
            got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise RuntimeError(f"{path}: {key} is {got}, its model_args give a tensor of shape "
                               f"{tuple(ours[key])}")
    if not torch.equal(state["transformer.wte.weight"], state["lm_head.weight"]):
        raise RuntimeError(f"{path}: lm_head and wte differ, and nanoGPT's GPT ties them: a "
                           "modified nanoGPT, whose model this import would not reproduce exactly")
    return state
