"""Parallel tree pruning (paper §3.2.3): drop unlikely tree nodes before the streams are inserted.

A tree pass runs the layers below N - Ns on all n nodes anyway. There, a rank-r adapter
o_theta on the main stream followed by the final LayerNorm and the shared LM head gives
an *early* next-token distribution at every node, hence an early transition probability
parent -> child for every edge of the tree. Nodes whose transition probability is below
a threshold are dropped with their subtrees, so the top Ns layers, where every node also
carries gamma stream rows, process fewer tokens. Pruning only removes drafts: the
verified output is unchanged. The adapter is trained with the next-token loss.
"""
import torch
import torch.nn as nn



class PruningAdapter(nn.Module):
    """o_theta: h + up(down(h)), then ln_f and the LM head give the early logits."""

    def __init__(self, n_embd, rank):
        super().__init__()
        self.down = nn.Linear(n_embd, rank, bias=False)
        self.up = nn.Linear(rank, n_embd, bias=False)  # zero-initialised by GPT

    def early_logits(self, model, h):
        return model.lm_head(model.transformer.ln_f(h + self.up(self.down(h))))


@torch.no_grad()
def pruned_pass(model, tokens, shape, tree, cache, threshold):
    """A tree pass (GPT.forward_nodes) with pruning between GPT.forward_bottom and GPT.forward_top,
    for one row (B = 1: which nodes survive is decided on the host).

    tokens: (1, n) the tree's tokens; shape: its TreeShape (tree.py); tree: the tree that made
    it. At layer N - Ns the early transition probability of every edge decides which nodes
    survive; a dropped node takes its subtree with it. Returns the surviving nodes' tokens
    and shape (a subset of the same template), root first, then what GPT.forward_top returns
    for them. The bottom layers' cached K/V of the kept nodes move to slots L..L+kept-1;
    those of dropped nodes are simply not kept.
    """
    L, n = int(cache.length[0]), shape.n_nodes
    positions = (cache.length[:, None] + shape.depth).clamp(max=model.config.block_size - 1)
    h = model.forward_bottom(tokens, positions, cache.mask(shape.window), cache, tree.draft_depth)
    if n > 1:
        parents = shape.parent[0].tolist()
        early_probs = torch.softmax(model.prune_adapter.early_logits(model, h[0, parents[1:]]).float(), dim=-1)
        p_edge = early_probs.gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist()  # P(child token | parent), early
        alive = [True] + [False] * (n - 1)
        for u in range(1, n):  # parents come first, so a dropped node's subtree goes with it
            alive[u] = alive[parents[u]] and p_edge[u - 1] >= threshold
        kept = [u for u in range(n) if alive[u]]
        if len(kept) < n:
            shape = tree.subshape(shape, kept)
            k = torch.tensor(kept, device=h.device)
            first_msa = model.config.n_layer - model.config.n_msa_layers
            for kv in cache.kv[:first_msa]:
                kv[:, L:L + len(kept)] = kv[:, L + k]
            h, tokens = h[:, k], tokens[:, k]
    return (tokens, shape, *model.forward_top(h, cache.mask(shape.window), cache=cache,
                                              draft_depth=tree.draft_depth))
