"""Training (paper Eq. 5): the forward over a chain of tokens and its loss,
L = CE(main) + sum_j alpha_j CE(stream j), alpha_0 = 1.

Training is decoding's special case of a tree that is a chain: the pass mask is masks.py's rule
on a chain (`chain_mask`), with streams at every position, or at every k-th
(`stream_stride=k`, an offset drawn per batch: cheaper steps; the main stream is unchanged).
"""
import torch
import torch.nn.functional as F

from .masks import pass_mask, tree_mask


def chain_mask(model, T, device, where=None):
    """Training's pass mask: the decoding rule (masks.py) on a chain, with streams at the
    positions `where` (a range; None = all). Built once per model, length and positions."""
    key = (T, str(device), where and (where.start, where.step))
    if key not in model._masks:
        anc = tree_mask(range(-1, T - 1))[None]
        idx = None if where is None else torch.tensor(list(where))[None]
        model._masks[key] = pass_mask(anc, model.config.n_streams, idx)[0].to(device)
    return model._masks[key]


def train_forward(model, idx, targets=None, teacher=None):
    """The forward over a chain idx (B, T): (main logits, draft logits, losses).

    losses, when targets are given: 'loss' = Eq. 5, CE(main) + sum_j alpha_j CE(stream j);
    'main' and 'streams' (CE against the data, for logging). targets[b, t] = x_{t+1};
    stream j at t learns x_{t+1+j} = targets[b, t+j], or the soft targets of
    teacher(model, idx, main_logits, where) -> fn(j, t) (distillation, extras/distill.py).
    Positions past the end and targets of -1 are ignored; a stream left with no target
    adds 0. stream_stride=k > 1 (training mode only): streams run at positions offset,
    offset + k, ... (offset drawn per batch); the main stream is unchanged."""
    cfg, T = model.config, idx.shape[1]
    if T > cfg.block_size:
        raise ValueError(f"sequence length {T} > block_size {cfg.block_size}")
    k = cfg.stream_stride if model.training and cfg.n_drafts else 1
    offset = int(torch.randint(min(k, T), ())) if k > 1 else 0  # some position has streams
    where = None if k == 1 else range(offset, T, k)
    mask = chain_mask(model, T, idx.device, where)
    stream_idx = None if where is None else torch.tensor(list(where), device=idx.device)[None]
    h = model.forward_bottom(idx, torch.arange(T, device=idx.device), mask)
    main_logits, draft_logits = model.forward_top(h, mask, stream_idx=stream_idx)
    if targets is None:
        return main_logits, draft_logits, None
    soft = teacher(model, idx, main_logits, where) if teacher else None
    losses = stream_loss(cfg, main_logits, draft_logits, targets, where, soft)
    return main_logits, draft_logits, losses


def stream_loss(config, main_logits, draft_logits, targets, where, soft=None):
    """Eq. 5 over the positions `where` that carried streams (None = all)."""
    V, T = main_logits.shape[-1], targets.shape[1]
    start, k = (0, 1) if where is None else (where.start, where.step)
    main = F.cross_entropy(main_logits.reshape(-1, V), targets.reshape(-1), ignore_index=-1)
    loss, stream_losses = main, []
    for j in range(1, config.n_drafts + 1):
        t = torch.arange(start, max(start, T - j), k, device=targets.device)  # t + j < T
        s, y = draft_logits[:, :len(t), j - 1], targets[:, t + j]
        valid = y != -1  # padding trains no stream, as it trains no main position
        n = valid.sum().clamp(min=1)  # no target at all adds 0, not an empty mean's NaN
        lj = F.cross_entropy(s.reshape(-1, V), y.reshape(-1), ignore_index=-1,
                             reduction="sum") / n
        stream_losses.append(lj)
        if soft is not None:  # soft targets: the main stream's distributions
            lj = -((soft(j, t) * F.log_softmax(s.float(), -1)).sum(-1) * valid).sum() / n
        loss = loss + config.stream_loss_weight * lj
    return {"loss": loss, "main": main, "streams": stream_losses}
