"""Train a GPT with speculative streams (paper Eq. 5: main CE + sum_j alpha_j CE of stream j).

    python train.py                                 # the default: char-level Python code
    python train.py --dataset=shakespeare           # prose
    python train.py --n_streams=0 --out_dir=out-ar  # the same model without streams
    python train.py --init_from=out-ar/ckpt.pt --out_dir=out-ft   # add streams to it
    python train.py --init_from=nanogpt:../nanoGPT/out-shakespeare-char --freeze_base=True \\
        --dataset=text:../nanoGPT/data/shakespeare_char/input.txt \\
        --out_dir=out-from-nanogpt                  # streams for nanoGPT's model
    torchrun --nproc_per_node=2 train.py --gradient_accumulation_steps=2  # DDP, 1 step per process
"""
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ss_mini.io.checkpoint import (is_draft_param, make_checkpoint, model_config, param_counts,
                                   save_checkpoint)
from ss_mini.io.pretrained import crop_block_size, load_gpt2
from ss_mini.io.cli import (UsageError, at_least, in_range, one_of, parse_args, pick_device,
                            pick_dtype)
from ss_mini.io.data import Tokenizer, fingerprint, load_split, prepare
from ss_mini.extras import build_model
from ss_mini.extras.distill import stream_teacher
from ss_mini.extras.medusa import init_medusa_heads
from ss_mini.model import GPTConfig
from ss_mini.io.run_start import MODEL_KEYS, check_config, make_optimizer

# ----------------------------------------------------------------------------- config
config = dict(
    out_dir="out",  # where ckpt.pt is written
    dataset="python",  # python | shakespeare | text:PATH
    tokenizer="char",  # char | gpt2
    data_dir="data",  # where the tokenised datasets are prepared (once)
    # scratch | resume (out_dir/ckpt.pt) | PATH of a checkpoint | gpt2:DIR or gpt2:NAME
    # | nanogpt:PATH
    init_from="scratch",
    # nanogpt: its char vocabulary; "" = meta.pkl beside the dataset's text, else in nanoGPT's
    # data/<dataset>/
    meta_pkl="",
    eval_interval=400,  # iterations between evaluations (and checkpoints)
    eval_iters=20,  # batches per evaluation
    log_interval=25,  # iterations between log lines
    always_save_checkpoint=False,  # else only when val loss improves on the checkpoint's
    overwrite=False,  # a fresh run (init_from != resume) may replace out_dir/ckpt.pt
    # model (GPTConfig): small enough to train on a laptop's CPU in minutes (docs/defaults.md)
    n_layer=4,
    n_head=4,  # attention heads
    n_embd=128,  # model width d
    block_size=128,  # context length
    dropout=0.0,  # dropout rate (0 = off)
    bias=True,  # biases in Linear and LayerNorm (GPT-2: True)
    n_streams=4,  # gamma, as the paper (3 against 4: docs/defaults.md)
    n_msa_layers=1,  # Ns: top layers with multi-stream attention
    # alpha_j of Eq. 5 (paper: 0.1); 0.3 drafts better at the same main loss (docs/defaults.md)
    stream_loss_weight=0.3,
    # main (distil the main stream at t+j) | data (x_{t+1+j}, the paper's Eq. 5) | greedy (the main
    # stream along its own greedy continuation: for a lossless fine-tune, docs/lossless-prose.md)
    stream_targets="main",
    # streams at every k-th position of a batch: cheaper steps; 1 = all, as the paper
    stream_stride=2,
    stream_adapter_rank=0,  # > 0: low-rank stream-only adapters in the MSA layers (for freeze_base)
    n_medusa_heads=0,  # the Medusa baseline drafter instead of streams (use with --n_streams=0)
    prune_adapter_rank=0,  # > 0: train a parallel tree pruning adapter of this rank (paper: 8)
    # lossless mode: train only the streams (P and adapters); the main stream stays exact
    freeze_base=False,
    # optimisation
    batch_size=16,
    gradient_accumulation_steps=1,  # micro-batches per optimizer step
    learning_rate=2e-3,  # peak learning rate (AdamW)
    max_iters=1800,  # optimizer steps
    weight_decay=0.1,  # AdamW weight decay (biases, norms and P do not decay)
    beta1=0.9,  # AdamW beta1
    beta2=0.99,  # AdamW beta2
    grad_clip=1.0,  # clip the gradient norm at this (0 = off)
    warmup_iters=50,  # linear warm-up steps, then cosine decay
    min_lr=2e-4,  # cosine decay from learning_rate to min_lr at max_iters
    # system
    device="auto",  # auto | cpu | cuda | cuda:N | mps
    dtype="auto",  # auto (bf16/fp16 on CUDA, fp32 elsewhere) | float32 | bfloat16 | float16
    compile=False,  # torch.compile the training step
    seed=1337,  # one command and seed give bit-identical weights on one CPU kind
)
RULES = dict(
    eval_interval=at_least(1), eval_iters=at_least(1), log_interval=at_least(1),
    n_layer=at_least(1), n_head=at_least(1), n_embd=at_least(1), block_size=at_least(2),
    dropout=in_range(0.0, 1.0, hi_open=True), n_streams=at_least(0), n_msa_layers=at_least(0),
    stream_loss_weight=at_least(0.0), stream_stride=at_least(1), stream_adapter_rank=at_least(0),
    n_medusa_heads=at_least(0), prune_adapter_rank=at_least(0), batch_size=at_least(1),
    gradient_accumulation_steps=at_least(1), learning_rate=in_range(0.0, 1.0, lo_open=True),
    max_iters=at_least(1), weight_decay=at_least(0.0), beta1=in_range(0.0, 1.0, hi_open=True),
    beta2=in_range(0.0, 1.0, hi_open=True), grad_clip=at_least(0.0), warmup_iters=at_least(0),
    min_lr=at_least(0.0), tokenizer=one_of("char", "gpt2"),
    stream_targets=one_of("data", "main", "greedy"),
    init_from=(lambda v: v in ("scratch", "resume") or v.startswith(("gpt2:", "nanogpt:"))
               or os.path.exists(v),
               "scratch, resume, gpt2:DIR, nanogpt:PATH (nanoGPT's out_dir) or the path of a "
               "checkpoint that exists"),
    meta_pkl=(lambda v: not v or os.path.isfile(v),
              "the path of a nanoGPT meta.pkl that exists (or empty)"),
    dataset=(lambda v: v in ("python", "shakespeare") or v.startswith("text:"),
             "python, shakespeare or text:PATH"),
)
STREAM_KEYS = ("n_streams", "n_msa_layers", "stream_loss_weight", "stream_targets",
               "stream_stride", "stream_adapter_rank", "n_medusa_heads", "prune_adapter_rank",
               "dropout")  # what fine-tuning may change


def get_lr(it, cfg):
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    ratio = min(1.0, (it - cfg["warmup_iters"]) / max(1, cfg["max_iters"] - cfg["warmup_iters"]))
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"]
                                                                      - cfg["min_lr"])


# ----------------------------------------------------------------------------- processes
def steps_per_process(steps, world):
    """Each of the world processes' share of the gradient accumulation steps (the whole run's)."""
    if steps % world:
        fix = -(-steps // world) * world  # the next multiple
        raise UsageError(f"--gradient_accumulation_steps={steps} does not split among {world} "
                         f"processes: give --gradient_accumulation_steps={fix} (a multiple of "
                         f"the {world} processes)")
    return steps // world


def start_processes(cfg):
    """(ddp, rank, world, device) of this process: under torchrun (RANK set) one process per
    device, each with its share of the gradient accumulation steps."""
    if int(os.environ.get("RANK", -1)) == -1:
        return False, 0, 1, pick_device(cfg["device"])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    device = pick_device(cfg["device"])
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    cfg["gradient_accumulation_steps"] = steps_per_process(cfg["gradient_accumulation_steps"],
                                                           world)
    return True, rank, world, device


class Run:
    """This process's part of the run: its rank, device, dtype and autocast, and a log that
    only the first process (the master) writes."""

    def __init__(self, cfg, ddp, rank, world, device):
        self.ddp, self.rank, self.world, self.device = ddp, rank, world, device
        self.master = rank == 0
        self.dtype = pick_dtype(cfg["dtype"], device)
        self.device_type = device.split(":")[0]
        torch.manual_seed(cfg["seed"] + rank)
        self.autocast = (nullcontext() if self.dtype in ("float32", "float64")
                         else torch.autocast(self.device_type, dtype=getattr(torch, self.dtype)))

    def log(self, *a):
        if self.master:
            print(*a, flush=True)


# ----------------------------------------------------------------------------- data
def load_data(cfg, source, run):
    """(the train and val tokens, the tokenizer, the corpus's fingerprint); rank 0 prepares
    the dataset and the other processes read what it wrote."""
    # a vocabulary from nanoGPT's meta.pkl stays the model's: the dataset is encoded with it
    chars = source["tokenizer"].get("chars") if cfg["meta_pkl"] else None
    if run.master:
        folder, meta = prepare(cfg["dataset"], cfg["tokenizer"], cfg["data_dir"], chars)
    if run.ddp:
        dist.barrier()
    if not run.master:
        folder, meta = prepare(cfg["dataset"], cfg["tokenizer"], cfg["data_dir"], chars)
    tokenizer = Tokenizer(meta)
    data = {s: load_split(folder, s) for s in ("train", "val")}
    return data, tokenizer, fingerprint(folder, meta)  # every checkpoint keeps it: bench prints it


# ----------------------------------------------------------------------------- model
def make_model(cfg, source, tokenizer, log):
    """The model to train and (the iteration, the selection loss of the checkpoint on disk) to
    start from: a new model, GPT-2's weights, or a checkpoint's (resumed or fine-tuned)."""
    iter_num, ckpt_val = 0, float("inf")
    if cfg["init_from"] == "scratch":
        margs = {k: cfg[k] for k in MODEL_KEYS}
        model = build_model(GPTConfig(**margs, vocab_size=tokenizer.vocab_size))
    elif cfg["init_from"].startswith("gpt2:"):
        model = load_gpt2(cfg["init_from"][5:], **{k: cfg[k] for k in STREAM_KEYS})
        # short contexts train faster
        crop_block_size(model, min(cfg["block_size"], model.config.block_size))
        cfg.update({k: getattr(model.config, k) for k in MODEL_KEYS})
    else:
        model = checkpoint_model(cfg, source, tokenizer)
        if cfg["init_from"] == "resume":
            iter_num = source["iter_num"]
            ckpt_val = source.get("selection_loss", source.get("val_loss"))
    if cfg["freeze_base"]:
        freeze_base(model, log)
    return model, iter_num, ckpt_val


def checkpoint_model(cfg, ckpt, tokenizer):
    """A checkpoint's model, resumed as it was or fine-tuned: the checkpoint's architecture with
    this run's streams, where draft parameters that do not fit the new streams start fresh."""
    resume = cfg["init_from"] == "resume"
    margs = dict(ckpt["model_args"])
    if ckpt["tokenizer"] != tokenizer.meta():
        raise UsageError(f"{cfg['init_from']} was trained with another vocabulary than "
                         f"{cfg['dataset']} ({cfg['tokenizer']}) has now; train on its own "
                         "dataset, or use --tokenizer=gpt2")
    if not resume:
        margs.update({k: cfg[k] for k in STREAM_KEYS})
        cfg.update({k: margs[k] for k in MODEL_KEYS})
    model = build_model(model_config(margs))
    ours = model.state_dict()
    state = {k: v for k, v in ckpt["model"].items()
             if resume or not is_draft_param(k) or (k in ours and ours[k].shape == v.shape)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not is_draft_param(k)]:
        raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, "
                           f"unexpected {unexpected}")
    if any(k.startswith("medusa_heads.") for k in missing):
        init_medusa_heads(model)  # new heads start from the loaded base head
    return model


def freeze_base(model, log):
    """Lossless mode: only the drafter trains, so the main stream stays the base model's."""
    if not model.config.n_drafts:
        raise UsageError("--freeze_base=True trains only the drafter: give the model streams "
                         "(--n_streams=3) or Medusa heads (--n_medusa_heads=3)")
    for name, p in model.named_parameters():
        p.requires_grad = is_draft_param(name)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"lossless mode: the base is frozen, {trainable:,} trainable parameters (the drafter's)")


# ----------------------------------------------------------------------------- loop, checkpoints
class Trainer:
    """The training loop and what it keeps from one iteration to the next: the model (compiled
    and data-parallel where asked), the optimizer, and the selection loss of the checkpoint on
    disk, which only a better model replaces."""

    def __init__(self, cfg, run, model, optimizer, data, tokenizer, corpus, iter_num, ckpt_val):
        self.cfg, self.run, self.optimizer, self.data = cfg, run, optimizer, data
        self.tokenizer, self.corpus = tokenizer, corpus
        # ckpt_val: the selection loss of the weights in ckpt_path
        self.iter_num, self.ckpt_val = iter_num, ckpt_val
        self.ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
        self.T = model.config.block_size
        self.what = "the streams' mean val" if cfg["freeze_base"] else "val"
        self.scaler = torch.amp.GradScaler(run.device_type, enabled=run.dtype == "float16")
        self.raw_model = model
        if cfg["compile"]:
            model = torch.compile(model)
        if run.ddp:
            ids = [int(run.device.split(":")[1])] if run.device_type == "cuda" else None
            model = DDP(model, device_ids=ids)
        self.model = model

    def batch(self, split):
        """batch_size random windows of block_size tokens of a split, and their next tokens."""
        d, T = self.data[split], self.T
        if len(d) <= T + 1:
            raise RuntimeError(f"the {split} split has {len(d)} tokens, fewer than block_size + 2 "
                               f"= {T + 2}; use a longer text or a smaller --block_size")
        ix = np.random.randint(0, len(d) - T - 1, self.cfg["batch_size"])
        x = torch.from_numpy(np.stack([d[i:i + T] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([d[i + 1:i + 1 + T] for i in ix]).astype(np.int64))
        device = self.run.device
        if self.run.device_type == "cuda":
            return (x.pin_memory().to(device, non_blocking=True),
                    y.pin_memory().to(device, non_blocking=True))
        return x.to(device), y.to(device)

    @torch.no_grad()
    def estimate_loss(self):
        """Mean val/train loss of the main stream and of each stream over eval_iters batches."""
        self.model.eval()
        out = {}
        for split in ("train", "val"):
            parts = torch.zeros(self.cfg["eval_iters"], 1 + self.raw_model.config.n_drafts)
            for k in range(self.cfg["eval_iters"]):
                x, y = self.batch(split)
                with self.run.autocast:
                    _, _, losses = self.raw_model(x, y, teacher=stream_teacher)
                parts[k] = torch.stack([losses["main"], *losses["streams"]]).float().cpu()
            out[split] = parts.mean(0).tolist()
        self.model.train()
        return out

    def evaluate(self):
        """Log the losses and save a checkpoint if the model got better; returns whether it
        saved."""
        losses = self.estimate_loss()
        val = losses["val"][0]
        # a checkpoint is kept when what this run trains gets better: in lossless mode only the
        # drafter learns and the main stream's loss cannot move, so the streams' mean loss counts
        score = sum(losses["val"][1:]) / len(losses["val"][1:]) if self.cfg["freeze_base"] else val
        streams = " ".join(f"s{j + 1} {v:.3f}" for j, v in enumerate(losses["val"][1:]))
        self.run.log(f"step {self.iter_num}: train {losses['train'][0]:.4f}, val {val:.4f} (main "
                     "stream)" + (f"; val per stream: {streams}" if streams else ""))
        if not self.run.master or self.iter_num == self.start_iter:
            return False
        # a worse model never replaces a better one, unless always_save_checkpoint says so
        if score < self.ckpt_val or self.cfg["always_save_checkpoint"]:
            self.save(losses["val"], score)
            return True
        self.run.log(f"not saved: {score:.4f} is not better than the {self.ckpt_val:.4f} of "
                     f"{self.ckpt_path}")
        return False

    def save(self, val_losses, score):
        """Write the checkpoint (atomically) and take its score as the one to beat."""
        save_checkpoint(make_checkpoint(
            self.raw_model, optimizer=self.optimizer.state_dict(), iter_num=self.iter_num,
            val_loss=val_losses[0], selection_loss=score, val_losses=val_losses, config=self.cfg,
            tokenizer=self.tokenizer.meta(), corpus=self.corpus,
            train_seconds=time.time() - self.t_start), self.ckpt_path)
        self.run.log(f"saved {self.ckpt_path} ({self.what} {score:.4f}"
                     + ("" if score < self.ckpt_val else f", not better than the "
                        f"{self.ckpt_val:.4f} it replaced: always_save_checkpoint=True") + ")")
        self.ckpt_val = score

    def step(self, x, y):
        """One optimizer step over the gradient accumulation steps; returns the next batch and
        the last micro-step's loss (its share of the step's) and losses."""
        steps = self.cfg["gradient_accumulation_steps"]
        for micro in range(steps):
            if self.run.ddp:  # sync gradients only on the last micro-step
                self.model.require_backward_grad_sync = micro == steps - 1
            with self.run.autocast:
                _, _, losses = self.model(x, y, teacher=stream_teacher)
                loss = losses["loss"] / steps
            x, y = self.batch("train")  # fetch the next batch while the backward runs on GPU
            self.scaler.scale(loss).backward()
        if self.cfg["grad_clip"]:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["grad_clip"])
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return x, y, loss, losses

    def train(self):
        """The iterations up to max_iters, evaluated every eval_interval; Ctrl-C ends in one
        line."""
        cfg, run = self.cfg, self.run
        np.random.seed(cfg["seed"] + run.rank)
        tokens_per_iter = (cfg["gradient_accumulation_steps"] * run.world * cfg["batch_size"]
                           * self.T)
        run.log(f"training on {run.device} ({run.dtype}), {run.world} process(es), "
                f"{tokens_per_iter:,} tokens per iteration, {cfg['max_iters']} iterations")
        x, y = self.batch("train")
        t0 = self.t_start = time.time()
        dt_avg, self.start_iter = None, self.iter_num
        # the last iteration evaluated (or the start): the weights since are untried
        self.evaluated = self.start_iter
        try:
            while True:
                lr = get_lr(self.iter_num, cfg)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                if self.iter_num % cfg["eval_interval"] == 0 or self.iter_num == cfg["max_iters"]:
                    self.evaluate()
                    self.evaluated = self.iter_num
                if self.iter_num >= cfg["max_iters"]:
                    break
                x, y, loss, losses = self.step(x, y)
                self.iter_num += 1
                t1 = time.time()
                dt, t0 = t1 - t0, t1
                # the first iterations include warm-up and compilation: the average starts later
                warm = dt_avg is None or self.iter_num <= self.start_iter + 2
                dt_avg = dt if warm else 0.9 * dt_avg + 0.1 * dt
                if self.iter_num % cfg["log_interval"] == 0:
                    left = dt_avg * (cfg["max_iters"] - self.iter_num)
                    loss_value = loss.item() * cfg["gradient_accumulation_steps"]
                    run.log(f"iter {self.iter_num}: loss {loss_value:.4f} (main "
                            f"{losses['main'].item():.4f}), lr {lr:.2e}, {dt_avg * 1000:.0f} "
                            f"ms/iter and {tokens_per_iter / dt_avg:,.0f} tokens/s (moving "
                            f"average), {left / 60:.1f} min left")
        except KeyboardInterrupt:
            self.interrupted()
        run.log(f"done: {self.iter_num} iterations in {(time.time() - self.t_start) / 60:.1f} min; "
                f"{self.ckpt_path} holds " + ("the streams' mean val loss" if cfg["freeze_base"]
                                              else "val loss") + f" {self.ckpt_val:.4f}")

    def interrupted(self):
        """Ctrl-C: the iterations since the last evaluation (up to eval_interval) are kept if the
        model got better; says in one line what is on disk and how to continue."""
        what, path = self.what, self.ckpt_path
        resume = ("; continue with python train.py --init_from=resume "
                  f"--out_dir={self.cfg['out_dir']}")
        try:
            if self.run.master and self.iter_num > self.evaluated:
                line = (f"checkpoint saved at iter {self.iter_num} ({what} {self.ckpt_val:.4f})"
                        if self.evaluate()
                        else f"the saved checkpoint ({what} {self.ckpt_val:.4f}) is better; not "
                        "replaced")
                raise SystemExit(f"\ninterrupted: {line}{resume}") from None
        except KeyboardInterrupt:  # pressed again: saves are atomic, so the checkpoint is whole
            pass
        where = (f"the last checkpoint is {path} ({what} {self.ckpt_val:.4f}){resume}"
                 if os.path.exists(path) else "no checkpoint written")
        raise SystemExit(f"\ninterrupted at iteration {self.iter_num}: {where}") from None


# ----------------------------------------------------------------------------- main
def main(argv=None):
    given = set()
    cfg = parse_args(config, argv, __doc__, given=given)
    source = check_config(cfg, given, RULES)
    run = Run(cfg, *start_processes(cfg))
    data, tokenizer, corpus = load_data(cfg, source, run)
    model, iter_num, ckpt_val = make_model(cfg, source, tokenizer, run.log)
    model.to(run.device)
    base, draft = param_counts(model)
    run.log(f"model: {base:,} base parameters + {draft:,} draft parameters (stream embeddings, "
            "gamma x d)")
    optimizer = make_optimizer(model, cfg["weight_decay"], cfg["learning_rate"],
                               (cfg["beta1"], cfg["beta2"]), run.device_type)
    if cfg["init_from"] == "resume":
        optimizer.load_state_dict(source["optimizer"])
    Trainer(cfg, run, model, optimizer, data, tokenizer, corpus, iter_num, ckpt_val).train()
    if run.ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted before training started; no checkpoint was written or changed")
