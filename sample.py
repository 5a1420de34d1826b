"""Sample from a trained model, autoregressively or with Speculative Streaming.

    python sample.py                                  # plain KV-cached decoding, T = 0.8, top-k 200
    python sample.py --speculative                    # each pass verifies a draft, drafts the next
    python sample.py --speculative --temperature=0    # greedy: the same text as plain decoding
    python sample.py --speculative --tree=n16 --start="def main():"
    python sample.py --start=FILE:prompt.txt --top_p=0.95
    python sample.py --speculative --trace=trace.html # each pass's tree, verification and mask

The sampling defaults are nanoGPT's (temperature 0.8, top-k 200). Sampling with
--speculative draws from the same distribution as plain decoding, not the same draws;
greedy decoding (--temperature=0) gives the same text with and without --speculative,
token for token: that is the exactness check.

stdout holds only the samples (prompt + continuation, separated by a line of dashes);
per-sample statistics and diagnostics go to stderr. With --speculative on a terminal,
each pass's tokens are shown in alternating colours. --trace=FILE.html (or .json) records
every pass of the first sample: what the streams drafted, what the main stream accepted and
the attention mask it used (ss_mini/lab/trace.py); the page opens from disk in any browser.
"""
import os
import sys
import time
import warnings

import torch

from ss_mini.io.checkpoint import load_model
from ss_mini.io.cli import (UsageError, at_least, check, in_range, parse_args, pick_device,
                            pick_dtype, warn_unused)
from ss_mini.extras.compile import compile_step
from ss_mini.extras.pruning import pruned_step
from ss_mini.baseline import ar_step, generate_ar
from ss_mini.generate import generate_speculative
from ss_mini.step import speculative_step
from ss_mini.lab.trace import Trace, check_path
from ss_mini.extras import make_tree

config = dict(
    out_dir="out",  # the checkpoint to sample from (out_dir/ckpt.pt)
    start="\n",  # the prompt, or FILE:path to read it from a file
    # decoded as one batch (each sample is exact; one random generator for the batch)
    num_samples=1,
    max_new_tokens=500,  # tokens to generate per sample
    # 0 = greedy (the exactness check: the same text with and without --speculative)
    temperature=0.8,
    top_k=200,  # 0 = off
    top_p=1.0,  # 1.0 = off
    seed=1337,  # the sampling seed (one seed gives other text with and without --speculative)
    device="auto",  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    # auto (bf16/fp16 on CUDA, fp32 elsewhere) | float32 | bfloat16 | float16 | float64
    dtype="auto",
    speculative=False,  # decode with Speculative Streaming (else plain autoregressive decoding)
    # chain (top-1 at every depth), top-k per depth (the paper's Cartesian tree, e.g. 3,2,1), nN
    # for N nodes
    tree="chain",
    # > 0: parallel tree pruning (models trained with --prune_adapter_rank; greedy only)
    prune_threshold=0.0,
    color="auto",  # auto (on a terminal) | True | False
    threads=0,  # torch CPU threads; 0 = torch's default
    # compile each decoding step whole (torch.compile); compiling takes tens of seconds first
    compile=False,
    # eager decoding on a CPU with packed weights and a lean cache (extras/kernels.py, the same
    # values); False: the method's own classes, as on other devices (README: code paths)
    lean=True,
    trace="",  # FILE.html or FILE.json: record every pass of the first sample (with --speculative)
)
RULES = dict(num_samples=at_least(1), max_new_tokens=at_least(1), temperature=at_least(0.0),
             top_k=at_least(0), top_p=in_range(0.0, 1.0, lo_open=True),
             prune_threshold=in_range(0.0, 1.0), threads=at_least(0),
             color=(lambda v: v.lower() in ("auto", "true", "false", "1", "0", "yes", "no"),
                    "auto, True or False"))
COLORS = ("\033[34m", "\033[33m")  # blue, yellow
RESET = "\033[0m"


def read_prompt(start):
    if start.startswith("FILE:"):
        path = start[5:]
        if not os.path.isfile(path):
            raise UsageError(f"--start=FILE:{path}: no such file")
        return open(path, encoding="utf-8").read()
    return start


class StreamText:
    """The text of a growing output, piece by piece: a character whose UTF-8 bytes come in two
    passes (GPT-2's byte-level BPE) is shown once whole, not as two U+FFFD."""

    def __init__(self, decode):
        self.decode, self.tokens, self.shown = decode, [], 0

    def add(self, tokens, final=False):
        """The new text. A trailing U+FFFD may be half a character: it waits for more tokens,
        unless the output ends here (final)."""
        self.tokens += tokens
        text = self.decode(self.tokens)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        piece, self.shown = text[self.shown:end], end
        return piece


class Samples:
    """The samples on stdout: one sample's text as each pass makes it final (with --speculative
    and colour, each pass's tokens in the next colour), or a batch's samples whole at the end."""

    def __init__(self, decode, n, color):
        self.decode, self.n, self.color = decode, n, color
        self.streams, self.chunk_no = [StreamText(decode) for _ in range(n)], 0

    def show(self, row, tokens, final=False):
        piece = self.streams[row].add(tokens, final)
        if piece and self.color:
            piece = COLORS[self.chunk_no % 2] + piece + RESET
        self.chunk_no += 1
        sys.stdout.write(piece)
        sys.stdout.flush()

    def finish(self, prompt, outs):
        for out in outs:
            if self.n == 1:
                self.show(0, [], final=True)
            else:
                sys.stdout.write(self.decode(prompt + out))
            sys.stdout.write("\n---------------\n")
        sys.stdout.flush()


def check_flags(cfg):
    """The flags against their meanings and each other, before any work."""
    check(cfg, RULES)
    if not cfg["speculative"]:
        warn_unused(cfg, config, ("tree", "prune_threshold", "color"), "without --speculative")
    elif cfg["tree"] == "auto":
        raise UsageError("--tree=auto is bench.py's tree search: give sample.py a tree (e.g. "
                         "--tree=1,1,1 or 1+L8; python bench.py prints the one it picks)")
    elif cfg["prune_threshold"] and cfg["temperature"] > 0:
        raise UsageError(f"--prune_threshold is greedy only (it would bias sampling at "
                         f"--temperature={cfg['temperature']}): add --temperature=0")
    if cfg["prune_threshold"] and cfg["num_samples"] > 1:
        raise UsageError("--prune_threshold decodes one sample at a time: give --num_samples=1")
    if cfg["compile"] and (cfg["prune_threshold"] or cfg["trace"]):
        raise UsageError("--prune_threshold and --trace read each pass back on the host, which a "
                         "compiled step cannot: drop --compile")
    if cfg["trace"]:
        if not cfg["speculative"]:
            raise UsageError("--trace records the passes of speculative decoding: add "
                             "--speculative")
        check_path(cfg["trace"])
        if cfg["num_samples"] > 1:
            raise UsageError("--trace records the passes of one sample: give --num_samples=1")


def load(cfg):
    """(model, tokenizer) on the device and dtype asked for."""
    device = pick_device(cfg["device"])
    dtype = pick_dtype(cfg["dtype"], device)
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    model, tok, _ = load_model(cfg["out_dir"], device, getattr(torch, dtype), cfg["lean"])
    print(f"model {cfg['out_dir']}/ckpt.pt on {device} ({dtype})"
          + (", compiling" if cfg["compile"] else ""), file=sys.stderr)
    return model, tok


def encode(text, tok):
    if text:
        return tok.encode(text)
    prompt, shown = tok.empty_prompt()
    print(f"empty prompt: starting from {shown}", file=sys.stderr)
    return prompt


def speculative_tree(cfg, model):
    """The tree of --speculative (None without it), bound where the model is."""
    if not cfg["speculative"]:
        return None
    if model.config.n_drafts == 0:
        raise UsageError(f"--speculative needs a model with streams, and {cfg['out_dir']} has "
                         "n_streams=0; train one with python train.py --n_streams=3, or sample "
                         "without --speculative")
    tree = make_tree(cfg["tree"], model.config.n_drafts)
    if tree is None:
        raise UsageError("--tree=none is plain decoding: drop --speculative, or give a tree "
                         "(e.g. --tree=1,1,1)")
    weight = model.lm_head.weight  # bind the tree where the model is ("cuda" is cuda:0 there)
    return tree.bind(model.config, weight.device, weight.dtype)


def decode(model, prompts, tree, cfg, kw, trace):
    """(outputs, Stats) of the samples, decoded as one batch; with --compile, a short decode of
    the same batch first compiles the steps, and says how long it took."""
    speculative, prune = cfg["speculative"], cfg["prune_threshold"]
    step = speculative_step if speculative else ar_step
    if prune:
        step = pruned_step(model, prune, cfg["temperature"])
    if cfg["compile"]:
        step, t0, warm = compile_step(step), time.perf_counter(), dict(kw, on_tokens=None)
        if speculative:
            generate_speculative(model, prompts, 2, tree, step=step, **warm)
        else:
            generate_ar(model, prompts, 2, step=step, **warm)
        print(f"torch.compile: {time.perf_counter() - t0:.1f} s to compile the steps",
              file=sys.stderr)
    if speculative:
        return generate_speculative(model, prompts, cfg["max_new_tokens"], tree, step=step,
                                    observe=trace.observe if trace else None, **kw)
    return generate_ar(model, prompts, cfg["max_new_tokens"], step=step, **kw)


def report(cfg, stats, tree, trace, prompt, outs):
    """The statistics on stderr, and the trace written (with --trace)."""
    n = cfg["num_samples"]
    batch = f"{n} samples as one batch: " if n > 1 else ""
    kind = "speculative, tree " + str(tree) if cfg["speculative"] else "autoregressive"
    print(f"[{kind}] {batch}{stats.new_tokens} new tokens, {stats.tokens_per_s:.0f} tokens/s, "
          f"{stats.passes} forward passes (the prefill and any window rebuilds included), "
          f"{stats.mean_accepted:.2f} tokens per pass", file=sys.stderr)
    drafts = sum(stats.accepted) - len(stats.accepted)
    if cfg["speculative"] and tree.lookup_length and tree.ks and drafts:
        text = sum(stats.from_text) / drafts
        print(f"accepted drafts: {1 - text:.0%} from the streams, {text:.0%} from the text",
              file=sys.stderr)
    if trace:
        trace.finish(prompt, outs[0])
        trace.save(cfg["trace"])
        print(f"trace of {len(trace.passes)} decode passes (the prefill and window rebuilds are "
              f"not traced) written to {cfg['trace']} (the tokens/s above include recording it)",
              file=sys.stderr)


def main(argv=None):
    cfg = parse_args(config, argv, __doc__, flags=("speculative",))
    check_flags(cfg)
    text = read_prompt(cfg["start"])
    model, tok = load(cfg)
    prompt = encode(text, tok)
    tree = speculative_tree(cfg, model)
    color = (sys.stdout.isatty() if cfg["color"].lower() == "auto"
             else cfg["color"].lower() in ("true", "1", "yes"))
    n = cfg["num_samples"]
    samples = Samples(tok.decode, n, color and cfg["speculative"])
    kw = dict(temperature=cfg["temperature"], top_k=cfg["top_k"] or None, top_p=cfg["top_p"],
              seed=cfg["seed"], eot=tok.eot, on_tokens=samples.show if n == 1 else None)
    trace = None
    if cfg["trace"]:
        trace = Trace(tok.decode, eot=tok.eot, model=cfg["out_dir"], tree=str(tree),
                      temperature=cfg["temperature"], top_k=cfg["top_k"], top_p=cfg["top_p"],
                      prune_threshold=cfg["prune_threshold"], seed=cfg["seed"])
    if n == 1:
        sys.stdout.write(tok.decode(prompt))
    outs, stats = decode(model, [prompt] * n, tree, cfg, kw, trace)
    samples.finish(prompt, outs)
    report(cfg, stats, tree, trace, prompt, outs)


if __name__ == "__main__":
    warnings.formatwarning = lambda msg, *a, **k: f"warning: {msg}\n"
    try:
        main()
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")
