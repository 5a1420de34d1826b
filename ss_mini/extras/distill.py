"""Distilled stream targets: what stream j at t learns instead of the data's x_{t+1+j}.

The paper's Eq. 5 trains stream j at t on the data token x_{t+1+j} (stream_targets="data").
Verification, though, accepts a draft when it is the *main stream's* token, not the data's.
Two targets that are closer to that, both soft (a distribution carries more signal per
position than one token) and both detached (the main stream is never pulled toward the
streams), as Medusa-2 and EAGLE train their drafters:

- "main": the main stream's own distribution at t+j, teacher-forced on the data;
- "greedy": the main stream's distribution at the j-th token of its own greedy continuation
  from t (`greedy_continuation`): exactly what greedy verification checks, since in a pass
  where the earlier drafts were accepted the tokens before the j-th are the main stream's
  argmaxes, not the data's. Useful for a lossless fine-tune of a frozen base.
"""
import torch

from ..kvcache import KVCache
from ..masks import tree_mask


def stream_teacher(model, idx, main_logits, where):
    """The soft target of stream j at positions t, as a function teacher(j, t) -> (B, len(t), V),
    or None for the data's tokens. where: the positions that carry streams (None = all)."""
    kind = model.config.stream_targets
    if kind == "data" or not model.config.n_drafts:  # no drafter: nothing to teach
        return None
    if kind == "main":
        return lambda j, t: torch.softmax(main_logits[:, t + j].detach().float(), dim=-1)
    continuation = greedy_continuation(model, idx, where)  # (B, m, gamma, V)
    return lambda j, t: continuation[:, :len(t), j - 1]


@torch.no_grad()
def greedy_continuation(model, idx, where=None):
    """(B, m, gamma, V): for each position t in `where` (m of them; None = every position), the
    main stream's distributions over the first gamma tokens of its own greedy continuation from t.

    It is a tree of main nodes over the batch, run with a KV cache like a decoding pass: the
    chain idx, then gamma levels, where level j holds, for every t, the argmax of level j - 1
    at position t + j (its parent; past the block the position is clamped, and those targets
    are never used). One pass per level, m rows each, in eval mode, so that dropout does not
    perturb the teacher. Memory: B x m x gamma x V probabilities (mind GPT-2's vocabulary).
    """
    B, T = idx.shape
    dev, g = idx.device, model.config.n_drafts
    t = torch.arange(T, device=dev) if where is None else torch.tensor(list(where), device=dev)
    m = len(t)
    masks, key = model._masks, ("greedy", T, where and (where.start, where.step), str(dev))
    if key not in masks:  # built once: the chain, then level j (parent t, or level j - 1)
        parents = list(range(-1, T - 1)) + t.tolist() + [T + i for i in range((g - 1) * m)]
        masks[key] = tree_mask(parents).to(dev)
    mask = masks[key]
    was_training = model.training
    model.eval()
    try:
        # every row holds as many tokens, so the cache's slots are the tree's nodes: a pass's
        # mask over all slots is its rows of the tree's mask (slots not yet written: hidden)
        dtype = model.lm_head.weight.dtype
        cache = KVCache(model.config, T + g * m, batch_size=B, device=dev, dtype=dtype)
        logits, _ = model.forward_nodes(idx, torch.arange(T, device=dev), mask[:T], cache=cache,
                                        draft_depth=0)
        cache.advance(torch.full((B,), T, device=dev))
        y, probs = logits[:, t].argmax(-1), []
        for j in range(1, g + 1):
            end = T + j * m
            logits, _ = model.forward_nodes(y, (t + j).clamp(max=T - 1), mask[end - m:end],
                                            cache=cache, draft_depth=0)
            cache.advance(torch.full((B,), m, device=dev))
            probs.append(torch.softmax(logits.float(), dim=-1))
            y = logits.argmax(-1)
    finally:
        model.train(was_training)
    return torch.stack(probs, dim=2)
