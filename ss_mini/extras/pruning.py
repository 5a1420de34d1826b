"""Parallel tree pruning (paper §3.2.3): drop unlikely tree nodes before the streams are inserted.

A tree pass runs the layers below N - Ns on all n nodes anyway. There, a rank-r adapter
o_theta on the main stream followed by the final LayerNorm and the shared LM head gives
an *early* next-token distribution at every node, hence an early transition probability
parent -> child for every edge of the tree. Nodes whose transition probability is below
a threshold are dropped with their subtrees, so the top Ns layers, where every node (but a
draft from the text) also carries gamma stream rows, process fewer tokens. Pruning only
removes drafts: the verified output is unchanged. The adapter is trained with the next-token
loss.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..loss import chain_mask
from ..model import GPT
from ..step import speculative_step
from ..tree import TreeShape


class PruningAdapter(nn.Module):
    """o_theta: h + up(down(h)), then ln_f and the LM head give the early logits."""

    def __init__(self, n_embd, rank):
        super().__init__()
        self.down = nn.Linear(n_embd, rank, bias=False)
        self.up = nn.Linear(rank, n_embd, bias=False)
        nn.init.normal_(self.down.weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.up.weight)  # the adapter starts as the identity

    def early_logits(self, model, h):
        return model.lm_head(model.transformer.ln_f(h + self.up(self.down(h))))


class PruningGPT(GPT):
    """A GPT with streams and the pruning adapter at layer N - Ns, which learns the next
    token there (its loss joins Eq. 5, weighted as a stream's)."""

    def __init__(self, config):
        super().__init__(config)
        self.prune_adapter = PruningAdapter(config.n_embd, config.prune_adapter_rank)

    def forward(self, idx, targets=None, teacher=None):
        main_logits, draft_logits, losses = super().forward(idx, targets, teacher)
        if targets is not None:  # the bottom layers again: the core's forward stays the paper's
            T = idx.shape[1]
            h = self.forward_bottom(idx, torch.arange(T, device=idx.device),
                                    chain_mask(self, T, idx.device))
            early = self.prune_adapter.early_logits(self, h)
            V = early.shape[-1]
            losses["prune"] = F.cross_entropy(early.reshape(-1, V), targets.reshape(-1),
                                              ignore_index=-1)
            losses["loss"] = losses["loss"] + self.config.stream_loss_weight * losses["prune"]
        return main_logits, draft_logits, losses


def pruned_step(model, threshold, temperature=0.0):
    """speculative_step with its forward pass pruned at `threshold` (greedy, one prompt)."""
    if not getattr(model, "prune_adapter", None):
        raise ValueError("prune_threshold needs a model trained with a pruning adapter "
                         "(--prune_adapter_rank=8)")
    if temperature > 0:
        raise ValueError("parallel tree pruning is greedy only: it drops drafts by their tokens, "
                         "which would bias speculative sampling; use temperature=0")
    return functools.partial(speculative_step, forward=functools.partial(pruned_forward,
                                                                         threshold=threshold))


@torch.no_grad()
def pruned_forward(model, cache, draft, tree, threshold):
    """step.forward_tree with pruning between GPT.forward_bottom and GPT.forward_top, for one
    row (B = 1: which nodes survive is decided on the host).

    At layer N - Ns the early transition probability of every edge decides which nodes
    survive; a dropped node takes its subtree with it. Returns the surviving draft (a subset
    of the same template, root first) and what GPT.forward_top gives for it. The bottom
    layers' cached keys and values of the kept nodes move to slots L..L+kept-1."""
    if draft.tokens.shape[0] != 1:
        raise ValueError("parallel tree pruning decodes one prompt at a time: give one prompt")
    shape, tokens = draft.shape, draft.tokens.clamp_min(0)  # a lookup that found nothing: -1
    L, n = int(cache.length[0]), shape.n_nodes
    positions = (cache.length[:, None] + shape.depth).clamp(max=model.config.block_size - 1)
    h = model.forward_bottom(tokens, positions, cache.mask(shape.window), cache, tree.draft_depth)
    if n > 1:
        parents = shape.parent[0].tolist()
        early = model.prune_adapter.early_logits(model, h[0, parents[1:]])
        p_edge = torch.softmax(early.float(), dim=-1).gather(-1, tokens[0, 1:, None])
        p_edge = p_edge.squeeze(-1).tolist()  # P(child token | parent), early
        alive = [True] + [False] * (n - 1)
        for u in range(1, n):  # parents come first, so a dropped node's subtree goes with it
            alive[u] = alive[parents[u]] and p_edge[u - 1] >= threshold
        kept = [u for u in range(n) if alive[u]]
        if len(kept) < n:
            shape = TreeShape(tree.template, shape.sel[:, kept], tree.draft_depth, tree.max_len,
                              tree.width)
            k = torch.tensor(kept, device=h.device)
            for kv in cache.kv[:model.first_msa_layer(tree.draft_depth)]:
                kv[:, L:L + len(kept)] = kv[:, L + k]
            h = h[:, k]
            draft = draft._replace(tokens=draft.tokens[:, k], shape=shape)
    main_logits, draft_logits = model.forward_top(h, cache.mask(shape.window), shape.stream_idx,
                                                  cache, tree.draft_depth)
    return draft, main_logits, draft_logits
