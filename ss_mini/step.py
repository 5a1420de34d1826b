"""One decoding step for every row of a batch, as the decoders (generate.py) run it.

`speculative_step` (paper §3.2) is four phases, each a function below:
  1. `draft_tree`: the root (the next token, decided) and candidates from the streams of the
     last accepted token, placed into the tree (tree.py);
  2. `forward_tree`: one pass over the tree: the main stream verifies every node, and the
     streams of every node (drafts from the text aside) draft the next step (model.py, masks.py);
  3. `verify`: the target's token at every node (sampling.py) and each row's accepted path;
  4. `accept`: each row keeps its path in its cache (kvcache.py); the streams of the path's
     last node (its root's for a draft from the text) are the next drafts.
A tree may also hold a chain drafted from the decoded text (prompt lookup, extras/lookup.py;
`lookup` None without one): nodes like any other, but without streams. With the method's
KVCache a step reads nothing back to the host and keeps its shapes, so one compiled graph serves
every step (extras/compile.py); the lean CPU path (extras/kernels.py) reads the lengths.
`prefill` is the pass over a prompt.
"""
from typing import NamedTuple

import torch

from .masks import attention_window, pass_mask
from .tree import TreeShape


class Draft(NamedTuple):
    """A tree draft in every row: tokens (B, n), the root first; its shape; the ranked candidates
    (B, D, width) from the draft logits (B, D, V) and, sampling, their distributions (else None);
    sampling with drafts from the text, the text's token each node tries first (else None)."""
    tokens: torch.Tensor
    shape: TreeShape
    ranked: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor | None
    look: torch.Tensor | None = None


class Verified(NamedTuple):
    """targets (B, n): the target's token at every node; path_length (B,): the nodes on each
    row's accepted path, root included (1..P, P the tree's depth + 1), so the tokens it emits;
    last (B,): the path's last node, as an index into the batch's B * n nodes."""
    targets: torch.Tensor
    path_length: torch.Tensor
    last: torch.Tensor


class Step(NamedTuple):
    """What a step gives each row: n_emitted (B,) tokens, the first n_emitted of emitted
    (B, P) (its accepted drafts, then the next root); the next root (B,); the next draft
    logits (B, D, V) of the D depths the tree drafts; and the nodes the pass verified."""
    n_emitted: torch.Tensor
    emitted: torch.Tensor
    root: torch.Tensor
    draft_logits: torch.Tensor
    n_nodes: int


def draft_tree(root, draft_logits, tree, sampler, depth_limit, lookup=None):
    """Phase 1 (§3.2.2): candidates ranked per depth from the draft logits (B, D, V) of each
    row's last accepted position, placed into the tree's shape under the root (B,); and the
    tokens of lookup (B, m), drafted from the decoded text, where a lookup tree puts them (the
    streams' candidates then leave its first token out: extras/lookup.py)."""
    exclude = lookup[:, :1, None] if lookup is not None and draft_logits.shape[1] else None
    ranked, probs = sampler.draft(draft_logits, tree.width, exclude)
    shape = tree.shape(draft_logits, probs, depth_limit)
    candidates = ranked.flatten(1)
    if lookup is not None:  # after the ranked candidates (tree.py: Template)
        candidates = torch.cat([candidates, lookup], 1)
    tokens = torch.cat([root.unsqueeze(1), candidates.gather(1, shape.token_index)], dim=1)
    look = tree.look(lookup) if lookup is not None and probs is not None else None
    return Draft(tokens, shape, ranked, draft_logits, probs, look)


def forward_tree(model, cache, draft, tree):
    """Phase 2: one pass over every node at position L + depth, each, except a draft from the text,
    with the streams of the depths the tree drafts (Eq. 2, 3). Nodes past block_size take its
    last position: verify never accepts them. Returns (the draft it ran, main logits (B, n, V),
    stream logits (B, m, D, V) of the m nodes with streams, or None if D = 0)."""
    positions = cache.length.unsqueeze(1) + draft.shape.depth
    positions = positions.clamp(max=model.config.block_size - 1)
    tokens = draft.tokens.clamp_min(0) if tree.lookup_length else draft.tokens  # -1: no chain
    main_logits, stream_logits = model.forward_nodes(
        tokens, positions, cache.mask(draft.shape.window), cache=cache,
        stream_idx=draft.shape.stream_idx, draft_depth=tree.draft_depth)
    return draft, main_logits, stream_logits


def verify(draft, main_logits, sampler, depth_limit):
    """Phase 3: the target's token at every node, and each row's accepted path. A node is
    accepted when every node on its path holds the token its parent emitted and it lies within
    depth_limit (B,); children hold distinct tokens, so one path is accepted, and its deepest
    node ends it. shape.anc leaves out the root: always accepted, it meets its own target."""
    shape = draft.shape
    targets = sampler.verify(main_logits, draft.probs, draft.ranked, shape, draft.look)
    miss = draft.tokens != targets.gather(1, shape.parent)
    miss |= shape.depth > depth_limit.unsqueeze(1)
    accepted = shape.path_length.masked_fill((shape.anc & miss.unsqueeze(1)).any(-1), 0)
    last = accepted.argmax(1) + shape.first_node  # the deepest accepted node
    return Verified(targets, accepted.flatten().index_select(0, last), last)


def accept(cache, draft, verified, stream_logits, tree):
    """Phase 4: each row's path moves into its cache; its last node's target token is the next
    root and its streams' logits (its root's for a draft from the text) the next drafts. A chain's
    path of a nodes is its first a nodes, already in place in the cache and in the targets."""
    length, last = verified.path_length, verified.last
    if tree.template.is_chain:
        cache.advance(length)
        emitted = verified.targets
    else:
        path = draft.shape.path.flatten(0, 1).index_select(0, last)
        cache.accept(path, length)
        emitted = verified.targets.gather(1, path)
    rows = draft.shape.next_draft_row
    row = last if rows is None else rows.index_select(0, last)
    next_drafts = (draft.logits if stream_logits is None  # no streams ran: (B, 0, V) stays
                   else stream_logits.flatten(0, 1).index_select(0, row))
    root = verified.targets.flatten().index_select(0, last)  # (index_select: MPS has no take)
    return Step(length, emitted, root, next_drafts, draft.shape.n_nodes)


def speculative_step(model, cache, root, draft_logits, tree, sampler, forward=forward_tree,
                     observe=None, lookup=None):
    """One pass of Speculative Streaming over the batch: verify the tree drafted from
    draft_logits (B, D, V) (and lookup, drafts from the text) under each row's root (B,), and
    draft the next. forward: phase 2 (extras/pruning.py gives another); observe(cache, draft,
    ran, verified, step): called with what the pass did (lab/trace.py)."""
    depth_limit = model.config.block_size - 1 - cache.length  # positions stay < block_size
    draft = draft_tree(root, draft_logits, tree, sampler, depth_limit, lookup)
    ran, main_logits, stream_logits = forward(model, cache, draft, tree)  # pruning may cut it
    verified = verify(ran, main_logits, sampler, depth_limit)
    step = accept(cache, ran, verified, stream_logits, tree)
    if observe is not None:
        observe(cache, draft, ran, verified, step)
    return step


@torch.no_grad()
def prefill(model, contexts, draft_depth, cache_slots=None):
    """One pass over each row's context, right-padded to the longest (padding comes after a row's
    tokens, where nothing real looks): (a cache with these rows, the main logits at each row's
    last token (B, V), its draft logits (B, D, V), D = 0 if draft_depth = 0). cache_slots: the
    decoder's cache size, its memory the model's from the last decode of this size (None: a new
    cache of the contexts and the last streams, for `KVCache.put_rows`)."""
    w = model.lm_head.weight
    B, n = len(contexts), max(map(len, contexts))
    idx = torch.tensor([c + c[-1:] * (n - len(c)) for c in contexts], device=w.device)
    last = torch.tensor([len(c) - 1 for c in contexts], device=w.device)[:, None]  # (B, 1)
    g = model.streams_in_pass(draft_depth)
    cache = model.cache_class(model.config, cache_slots or n + g, B, device=w.device,
                              dtype=w.dtype, memory=model.kv_memory if cache_slots else None)
    causal = torch.ones(n, n, dtype=torch.bool, device=w.device).tril().expand(B, n, n)
    window = attention_window(pass_mask(causal, g, stream_idx=last), cache.max_len, w.dtype)
    main_logits, draft_logits = model.forward_nodes(
        idx, torch.arange(n, device=w.device), cache.mask(window), cache=cache, stream_idx=last,
        draft_depth=draft_depth, main_idx=last)
    cache.advance(last[:, 0] + 1)
    drafts = main_logits[:, :0] if draft_logits is None else draft_logits[:, 0].contiguous()
    return cache, main_logits[:, 0], drafts
