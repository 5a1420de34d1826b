"""Train a GPT with speculative streams (paper Eq. 5: main CE + sum_j alpha_j CE of stream j).

    python train.py                                 # the default: char-level Python code
    python train.py --dataset=shakespeare           # prose
    python train.py --n_streams=0 --out_dir=out-ar  # the same model without streams
    python train.py --init_from=out-ar/ckpt.pt --out_dir=out-ft   # add streams to it
    python train.py --init_from=nanogpt:../nanoGPT/out-shakespeare-char --freeze_base=True \
        --dataset=text:../nanoGPT/data/shakespeare_char/input.txt --out_dir=out-from-nanogpt  # streams for nanoGPT's model
    torchrun --nproc_per_node=2 train.py --gradient_accumulation_steps=2   # data-parallel, one step per process
"""
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

from ss_mini.io.checkpoint import load_checkpoint, make_checkpoint, model_config, save_checkpoint
from ss_mini.io.pretrained import find_gpt2_files
from ss_mini.io.cli import UsageError, at_least, check, in_range, one_of, parse_args, pick_device, pick_dtype
from ss_mini.io.data import Tokenizer, fingerprint, load_split, prepare
from ss_mini.extras.medusa import init_medusa_heads
from ss_mini.model import GPT, GPTConfig
from ss_mini.io.nanogpt import import_nanogpt

# ----------------------------------------------------------------------------- config
config = dict(
    out_dir="out",
    dataset="python",  # python | shakespeare | text:PATH
    tokenizer="char",  # char | gpt2
    data_dir="data",
    init_from="scratch",  # scratch | resume (out_dir/ckpt.pt) | PATH of a checkpoint | gpt2:DIR or gpt2:NAME | nanogpt:PATH
    meta_pkl="",  # nanogpt: its char vocabulary; "" = meta.pkl beside the dataset's text, else in nanoGPT's data/<dataset>/
    eval_interval=400,
    eval_iters=20,
    log_interval=25,
    always_save_checkpoint=False,  # else only when val loss improves on the checkpoint's
    overwrite=False,  # a fresh run (init_from != resume) may replace out_dir/ckpt.pt
    # model (GPTConfig): small enough to train on a laptop's CPU in minutes; why each default: docs/defaults.md
    n_layer=4,
    n_head=4,
    n_embd=128,
    block_size=128,
    dropout=0.0,
    bias=True,
    n_streams=4,  # gamma, as the paper (3 against 4: docs/defaults.md)
    n_msa_layers=1,
    stream_loss_weight=0.3,  # alpha_j of Eq. 5 (paper: 0.1); 0.3 drafts better at the same main loss (docs/defaults.md)
    stream_targets="main",  # main (distil the main stream at t+j) | data (x_{t+1+j}, the paper's Eq. 5) | greedy
    # (the main stream along its own greedy continuation: for a lossless fine-tune, docs/lossless-prose.md)
    stream_stride=2,  # streams at every k-th position of a batch: cheaper steps; 1 = all, as the paper
    stream_adapter_rank=0,  # > 0: low-rank stream-only adapters in the MSA layers (for freeze_base)
    n_medusa_heads=0,  # the Medusa baseline drafter instead of streams (use with --n_streams=0)
    prune_adapter_rank=0,  # > 0: train a parallel tree pruning adapter of this rank (paper: 8)
    freeze_base=False,  # lossless mode: train only the streams (P and adapters); the main stream stays exact
    # optimisation
    batch_size=16,
    gradient_accumulation_steps=1,
    learning_rate=2e-3,
    max_iters=1800,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.99,
    grad_clip=1.0,
    warmup_iters=50,
    min_lr=2e-4,  # cosine decay from learning_rate to min_lr at max_iters
    # system
    device="auto",  # auto | cpu | cuda | cuda:N | mps
    dtype="auto",  # auto (bf16/fp16 on CUDA, fp32 elsewhere) | float32 | bfloat16 | float16
    compile=False,
    seed=1337,
)
RULES = dict(
    eval_interval=at_least(1), eval_iters=at_least(1), log_interval=at_least(1), n_layer=at_least(1),
    n_head=at_least(1), n_embd=at_least(1), block_size=at_least(2), dropout=in_range(0.0, 1.0, hi_open=True),
    n_streams=at_least(0), n_msa_layers=at_least(0), stream_loss_weight=at_least(0.0), stream_stride=at_least(1),
    stream_adapter_rank=at_least(0), n_medusa_heads=at_least(0), prune_adapter_rank=at_least(0),
    batch_size=at_least(1), gradient_accumulation_steps=at_least(1), learning_rate=in_range(0.0, 1.0, lo_open=True),
    max_iters=at_least(1), weight_decay=at_least(0.0), beta1=in_range(0.0, 1.0, hi_open=True),
    beta2=in_range(0.0, 1.0, hi_open=True), grad_clip=at_least(0.0), warmup_iters=at_least(0),
    min_lr=at_least(0.0), tokenizer=one_of("char", "gpt2"), stream_targets=one_of("data", "main", "greedy"),
    init_from=(lambda v: v in ("scratch", "resume") or v.startswith(("gpt2:", "nanogpt:")) or os.path.exists(v),
               "scratch, resume, gpt2:DIR, nanogpt:PATH (nanoGPT's out_dir) or the path of a checkpoint that exists"),
    meta_pkl=(lambda v: not v or os.path.isfile(v), "the path of a nanoGPT meta.pkl that exists (or empty)"),
)
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "n_streams", "n_msa_layers",
              "stream_loss_weight", "stream_targets", "stream_stride", "stream_adapter_rank", "n_medusa_heads",
              "prune_adapter_rank")
STREAM_KEYS = ("n_streams", "n_msa_layers", "stream_loss_weight", "stream_targets", "stream_stride", "stream_adapter_rank",
               "n_medusa_heads", "prune_adapter_rank", "dropout")  # what fine-tuning may change


def get_lr(it, cfg):
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    ratio = min(1.0, (it - cfg["warmup_iters"]) / max(1, cfg["max_iters"] - cfg["warmup_iters"]))
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])


def check_config(cfg, given):
    """Every flag against its meaning, and the run against what is on disk, before any work:
    a fresh run never replaces a checkpoint unless --overwrite=True says so; a resumed run
    takes its data, tokenizer and model from the checkpoint, and a flag that contradicts
    them is an error. Returns the checkpoint to start from (to resume, to fine-tune, or
    nanoGPT's, imported), or None."""
    check(cfg, RULES)
    if cfg["min_lr"] > cfg["learning_rate"]:
        raise UsageError(f"--min_lr={cfg['min_lr']} is above --learning_rate={cfg['learning_rate']}")
    g = max(cfg["n_streams"], cfg["n_medusa_heads"])
    k = cfg["stream_stride"] if g else 1
    if cfg["block_size"] < g + k + 1:  # the last stream needs a target at every offset: k - 1 + g < block_size
        raise UsageError(f"--block_size={cfg['block_size']} leaves stream {g} no target: use a block_size of at "
                         f"least the number of streams + stream_stride + 1 = {g + k + 1}")
    if cfg["init_from"] == "scratch":
        GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})  # its own checks (heads divide the width, Ns <= layers, ...)
    if cfg["init_from"].startswith("gpt2:"):
        if cfg["tokenizer"] != "gpt2":
            raise UsageError("--init_from=gpt2:... needs --tokenizer=gpt2 (GPT-2's own BPE)")
        find_gpt2_files(cfg["init_from"][5:])  # the weights exist before a dataset is tokenised
    nanogpt = cfg["init_from"].startswith("nanogpt:")
    if cfg["meta_pkl"] and not nanogpt:
        raise UsageError("--meta_pkl is the vocabulary of a nanoGPT checkpoint: give it with --init_from=nanogpt:PATH")
    ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
    if cfg["init_from"] != "resume":
        if os.path.exists(ckpt_path) and not cfg["overwrite"]:
            raise UsageError(f"{ckpt_path} exists: continue it with --init_from=resume, write elsewhere with "
                             "--out_dir=DIR, or replace it with --overwrite=True")
        if nanogpt:  # its weights, and its vocabulary: the dataset is encoded with nanoGPT's ids
            source = import_nanogpt(cfg["init_from"][8:], cfg["dataset"], cfg["meta_pkl"],
                                    cfg["block_size"] if "block_size" in given else None)
            kind = source["tokenizer"]["tokenizer"]
            if "tokenizer" in given and cfg["tokenizer"] != kind:
                raise UsageError(f"--tokenizer={cfg['tokenizer']} contradicts {source['source']}, which uses "
                                 f"{source['meta_pkl'] or 'GPT-2 BPE'}: drop the flag")
            cfg["tokenizer"], cfg["meta_pkl"] = kind, source["meta_pkl"]
            return source
        if cfg["init_from"] == "scratch" or cfg["init_from"].startswith("gpt2:"):
            return None
        source = load_checkpoint(cfg["init_from"])
        cfg["meta_pkl"] = source.get("config", {}).get("meta_pkl", "")  # a model imported from nanoGPT keeps its vocabulary
        return source
    ckpt = load_checkpoint(ckpt_path)
    saved = {**ckpt["config"], **ckpt["model_args"]}
    for key in ("dataset", "tokenizer", "meta_pkl") + MODEL_KEYS:
        if key in given and cfg[key] != saved.get(key, cfg[key]):
            raise UsageError(f"--{key}={cfg[key]!r} contradicts {ckpt_path}, trained with {key}={saved[key]!r}: "
                             "drop the flag to resume, or train a new model in another --out_dir")
        cfg[key] = saved.get(key, cfg[key])
    if "data_dir" not in given:
        cfg["data_dir"] = ckpt["config"].get("data_dir", cfg["data_dir"])
    if ckpt["iter_num"] >= cfg["max_iters"]:
        raise UsageError(f"{ckpt_path} is at iteration {ckpt['iter_num']}: give --max_iters above it to train on")
    return ckpt


def steps_per_process(steps, world):
    """Each of the world processes' share of the gradient accumulation steps (the whole run's)."""
    if steps % world:
        fix = -(-steps // world) * world  # the next multiple
        raise UsageError(f"--gradient_accumulation_steps={steps} does not split among {world} processes: "
                         f"give --gradient_accumulation_steps={fix} (a multiple of the {world} processes)")
    return steps // world


def main(argv=None):
    given = set()
    cfg = parse_args(config, argv, __doc__, given=given)
    source = check_config(cfg, given)
    ddp = int(os.environ.get("RANK", -1)) != -1  # set by torchrun
    if ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
        device = pick_device(cfg["device"])
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
        cfg["gradient_accumulation_steps"] = steps_per_process(cfg["gradient_accumulation_steps"], world)
    else:
        rank, world, device = 0, 1, pick_device(cfg["device"])
    master = rank == 0
    log = (lambda *a: print(*a, flush=True)) if master else (lambda *a: None)
    dtype = pick_dtype(cfg["dtype"], device)
    device_type = device.split(":")[0]
    torch.manual_seed(cfg["seed"] + rank)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64}[dtype]
    autocast = nullcontext() if dtype in ("float32", "float64") else torch.autocast(device_type, dtype=ptdtype)

    # ------------------------------------------------------------------------- data
    # a vocabulary from nanoGPT's meta.pkl stays the model's: the dataset is encoded with it
    chars = source["tokenizer"].get("chars") if cfg["meta_pkl"] else None
    if master:
        folder, meta = prepare(cfg["dataset"], cfg["tokenizer"], cfg["data_dir"], chars)
    if ddp:
        dist.barrier()  # rank 0 prepares, the others read what it wrote
    if not master:
        folder, meta = prepare(cfg["dataset"], cfg["tokenizer"], cfg["data_dir"], chars)
    tokenizer = Tokenizer(meta)
    data = {s: load_split(folder, s) for s in ("train", "val")}
    corpus = fingerprint(folder, meta)  # stored with every checkpoint: bench prints it

    # ------------------------------------------------------------------------- model
    ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
    iter_num, ckpt_val, ckpt = 0, float("inf"), None  # ckpt_val: the selection loss of the weights in ckpt_path
    if cfg["init_from"] == "scratch":
        margs = {k: cfg[k] for k in MODEL_KEYS}
        model = GPT(GPTConfig(**margs, vocab_size=tokenizer.vocab_size))
    elif cfg["init_from"].startswith("gpt2:"):
        model = GPT.from_pretrained(cfg["init_from"][5:], **{k: cfg[k] for k in STREAM_KEYS})
        model.crop_block_size(min(cfg["block_size"], model.config.block_size))  # short contexts train faster
        cfg.update({k: getattr(model.config, k) for k in MODEL_KEYS})
    else:
        resume = cfg["init_from"] == "resume"
        ckpt = source
        margs = dict(ckpt["model_args"])
        if ckpt["tokenizer"] != tokenizer.meta():
            raise UsageError(f"{cfg['init_from']} was trained with another vocabulary than {cfg['dataset']} "
                             f"({cfg['tokenizer']}) has now; train on its own dataset, or use --tokenizer=gpt2")
        if not resume:  # fine-tune: the architecture is the checkpoint's, the streams are this run's
            margs.update({k: cfg[k] for k in STREAM_KEYS})
            cfg.update({k: margs[k] for k in MODEL_KEYS})
        model = GPT(model_config(margs))
        ours = model.state_dict()
        # fine-tuning keeps the base weights; draft parameters that do not fit the new streams start fresh
        state = {k: v for k, v in ckpt["model"].items()
                 if resume or not GPT.is_draft_param(k) or (k in ours and ours[k].shape == v.shape)}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if not GPT.is_draft_param(k)]:
            raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
        if any(k.startswith("medusa_heads.") for k in missing):
            init_medusa_heads(model)  # new heads start from the loaded base head
        if resume:
            iter_num, ckpt_val = ckpt["iter_num"], ckpt.get("selection_loss", ckpt.get("val_loss"))
    if cfg["freeze_base"]:
        if not model.config.n_drafts:
            raise UsageError("--freeze_base=True trains only the drafter: give the model streams (--n_streams=3) "
                             "or Medusa heads (--n_medusa_heads=3)")
        for name, p in model.named_parameters():
            p.requires_grad = GPT.is_draft_param(name)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log(f"lossless mode: the base is frozen, {trainable:,} trainable parameters (the drafter's)")
    T = model.config.block_size
    model.to(device)
    base, draft = model.param_counts()
    log(f"model: {base:,} base parameters + {draft:,} draft parameters (stream embeddings, gamma x d)")
    optimizer = model.configure_optimizer(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]),
                                          device_type)
    if cfg["init_from"] == "resume":
        optimizer.load_state_dict(ckpt["optimizer"])
    ckpt = None
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
    raw_model = model
    if cfg["compile"]:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[int(device.split(":")[1])] if device_type == "cuda" else None)

    def get_batch(split):
        d = data[split]
        if len(d) <= T + 1:
            raise RuntimeError(f"the {split} split has {len(d)} tokens, fewer than block_size + 2 = {T + 2}; "
                               "use a longer text or a smaller --block_size")
        ix = np.random.randint(0, len(d) - T - 1, cfg["batch_size"])
        x = torch.from_numpy(np.stack([d[i:i + T] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([d[i + 1:i + 1 + T] for i in ix]).astype(np.int64))
        if device_type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    @torch.no_grad()
    def estimate_loss():
        """Mean val/train loss of the main stream and of each stream over eval_iters batches."""
        model.eval()
        out = {}
        for split in ("train", "val"):
            parts = torch.zeros(cfg["eval_iters"], 1 + raw_model.config.n_drafts)
            for k in range(cfg["eval_iters"]):
                x, y = get_batch(split)
                with autocast:
                    _, _, losses = raw_model(x, y)
                parts[k] = torch.stack([losses["main"], *losses["streams"]]).float().cpu()
            out[split] = parts.mean(0).tolist()
        model.train()
        return out

    def evaluate():
        """Log the losses and save a checkpoint if the model got better; returns whether it saved."""
        nonlocal ckpt_val
        losses = estimate_loss()
        val = losses["val"][0]
        # a checkpoint is kept when what this run trains gets better: in lossless mode only the
        # drafter learns and the main stream's loss cannot move, so there it is the streams' mean loss
        score = sum(losses["val"][1:]) / len(losses["val"][1:]) if cfg["freeze_base"] else val
        streams = " ".join(f"s{j + 1} {v:.3f}" for j, v in enumerate(losses["val"][1:]))
        log(f"step {iter_num}: train {losses['train'][0]:.4f}, val {val:.4f} (main stream)"
            + (f"; val per stream: {streams}" if streams else ""))
        if not master or iter_num == start_iter:
            return False
        # a worse model never replaces a better one, unless always_save_checkpoint says so
        if score < ckpt_val or cfg["always_save_checkpoint"]:
            save_checkpoint(make_checkpoint(
                raw_model, optimizer=optimizer.state_dict(), iter_num=iter_num, val_loss=val, selection_loss=score,
                val_losses=losses["val"], config=cfg, tokenizer=tokenizer.meta(), corpus=corpus,
                train_seconds=time.time() - t_start), ckpt_path)
            log(f"saved {ckpt_path} ({what} {score:.4f}" + ("" if score < ckpt_val else
                f", not better than the {ckpt_val:.4f} it replaced: always_save_checkpoint=True") + ")")
            ckpt_val = score
            return True
        log(f"not saved: {score:.4f} is not better than the {ckpt_val:.4f} of {ckpt_path}")
        return False

    np.random.seed(cfg["seed"] + rank)
    tokens_per_iter = cfg["gradient_accumulation_steps"] * world * cfg["batch_size"] * T
    log(f"training on {device} ({dtype}), {world} process(es), {tokens_per_iter:,} tokens per iteration, "
        f"{cfg['max_iters']} iterations")
    x, y = get_batch("train")
    t0 = t_start = time.time()
    dt_avg, start_iter = None, iter_num
    evaluated = start_iter  # the last iteration evaluated (or the start): the weights since are untried
    what = "the streams' mean val" if cfg["freeze_base"] else "val"
    try:
        while True:
            lr = get_lr(iter_num, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if iter_num % cfg["eval_interval"] == 0 or iter_num == cfg["max_iters"]:
                evaluate()
                evaluated = iter_num
            if iter_num >= cfg["max_iters"]:
                break
            for micro in range(cfg["gradient_accumulation_steps"]):
                if ddp:  # sync gradients only on the last micro-step
                    model.require_backward_grad_sync = micro == cfg["gradient_accumulation_steps"] - 1
                with autocast:
                    _, _, losses = model(x, y)
                    loss = losses["loss"] / cfg["gradient_accumulation_steps"]
                x, y = get_batch("train")  # fetch the next batch while the backward runs on GPU
                scaler.scale(loss).backward()
            if cfg["grad_clip"]:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            t1 = time.time()
            dt, t0 = t1 - t0, t1
            # the first iterations include warm-up (and compilation): the average starts after them
            dt_avg = dt if dt_avg is None or iter_num <= start_iter + 2 else 0.9 * dt_avg + 0.1 * dt
            if iter_num % cfg["log_interval"] == 0:
                left = dt_avg * (cfg["max_iters"] - iter_num)
                log(f"iter {iter_num}: loss {loss.item() * cfg['gradient_accumulation_steps']:.4f} (main "
                    f"{losses['main'].item():.4f}), lr {lr:.2e}, {dt_avg * 1000:.0f} ms/iter and "
                    f"{tokens_per_iter / dt_avg:,.0f} tokens/s (moving average), {left / 60:.1f} min left")
    except KeyboardInterrupt:
        resume = f"; continue with python train.py --init_from=resume --out_dir={cfg['out_dir']}"
        try:  # the iterations since the last evaluation (up to eval_interval) are kept if the model got better
            if master and iter_num > evaluated:
                line = (f"checkpoint saved at iter {iter_num} ({what} {ckpt_val:.4f})" if evaluate()
                        else f"the saved checkpoint ({what} {ckpt_val:.4f}) is better; not replaced")
                raise SystemExit(f"\ninterrupted: {line}{resume}") from None
        except KeyboardInterrupt:  # pressed again: saves are atomic, so the checkpoint on disk is whole
            pass
        where = (f"the last checkpoint is {ckpt_path} ({what} {ckpt_val:.4f}){resume}" if os.path.exists(ckpt_path)
                 else "no checkpoint written")
        raise SystemExit(f"\ninterrupted at iteration {iter_num}: {where}") from None
    log(f"done: {iter_num} iterations in {(time.time() - t_start) / 60:.1f} min; {ckpt_path} holds "
        + ("the streams' mean val loss" if cfg["freeze_base"] else "val loss") + f" {ckpt_val:.4f}")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted before training started; no checkpoint was written or changed")
