"""The two decoders: KV-cached autoregressive (`generate_ar`) and Speculative Streaming
(`generate_speculative`). Both return (new tokens, Stats) and call `on_tokens` with each
pass's tokens as soon as they are final.

One speculative step (paper §3.2):
  1. tree draft: root r (the next token, already decided) plus drafts from the
     streams q_1..q_gamma of the last accepted token          -> tree.py
  2. one forward pass over the tree: the main stream verifies every node, and the
     streams of every node draft for the step after            -> GPT.forward_nodes
     (optionally pruned half-way                               -> pruning.py)
  3. verify: walk from the root; at node u draw y from the target distribution p_u
     (argmax when greedy); if a child of u carries y go there, else stop: y is the
     next root                                                 -> `_walk`
  4. accept: keep the path's K/V in the cache (compaction); its last node's streams
     are the next drafts                                       -> KVCache.accept
Every emitted token is drawn from the same distribution as in plain decoding (the
drafts only choose where to look), so the method is lossless for sampling as well as
greedy; greedy outputs are token-for-token those of `generate_ar`.

Context longer than block_size: both decoders use the same sliding-window rule. When
the cache is full they rebuild it from the last block_size // 2 tokens (one prefill
pass) and go on; the tree is cut so that no position reaches block_size, so both
rebuild at the same token and greedy outputs stay identical.
"""
import time
import warnings
from dataclasses import dataclass, field

import torch

from .model import KVCache, stream_mask, tree_mask
from .pruning import prune_tree


@dataclass
class Stats:
    new_tokens: int = 0
    passes: int = 0  # forward passes, prefill and cache rebuilds included
    accepted: list = field(default_factory=list)  # tokens per decode pass (root included)
    nodes: list = field(default_factory=list)  # tree nodes verified per decode pass (after pruning)
    seconds: float = 0.0

    @property
    def tokens_per_s(self):
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted(self):
        """Mean accepted length tau: tokens emitted per decode pass, the root included."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


def target_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """The distribution that plain sampling draws from: softmax(logits / T), restricted to
    the top_k tokens and to the smallest set whose mass reaches top_p."""
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # mass before this token already reaches top_p
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Picker:
    """Draws the next token at one or many positions: argmax when temperature == 0."""

    def __init__(self, temperature, top_k, top_p, seed, device):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.gen = None
        if temperature > 0:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(seed if seed is not None else torch.seed())

    def __call__(self, logits):  # (n, V) -> (n,)
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = target_probs(logits, self.temperature, self.top_k, self.top_p)
        return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)


def _prepare(model, prompt, max_new_tokens):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least 1 token")
    prompt = list(prompt)
    if not prompt:
        raise ValueError("empty prompt: give at least one token (e.g. a newline or end-of-text)")
    T = model.config.block_size
    if len(prompt) > T:
        warnings.warn(f"prompt of {len(prompt)} tokens is longer than block_size={T}: keeping the last {T}")
        prompt = prompt[-T:]
    return prompt


def _prefill(model, ctx, cache, positions, with_streams):
    """Fill the cache with ctx; return the last position's main logits (V,) and streams (gamma, V)."""
    cache.reset()
    n = len(ctx)
    idx = torch.tensor([ctx], dtype=torch.long, device=positions.device)
    mask = tree_mask(range(-1, n - 1)).to(positions.device)
    stream_idx = torch.tensor([n - 1], device=positions.device) if with_streams else None
    main, streams = model.forward_nodes(idx, positions[:n], mask, stream_idx=stream_idx, cache=cache,
                                        streams=with_streams, last_only=True)
    cache.accept(n)
    return main[0, -1], (streams[0, -1] if with_streams else None)


@torch.inference_mode()
def generate_ar(model, prompt, max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=None, eot=None,
                on_tokens=None):
    """KV-cached autoregressive decoding: one token per forward pass (the baseline)."""
    t0 = time.perf_counter()
    ctx = _prepare(model, prompt, max_new_tokens)
    T, dev = model.config.block_size, model.lm_head.weight.device
    cache = KVCache(model.config, T, device=dev, dtype=model.lm_head.weight.dtype)
    positions = torch.arange(T, device=dev)
    pick = Picker(temperature, top_k, top_p, seed, dev)
    stats = Stats()
    logits, _ = _prefill(model, ctx, cache, positions, with_streams=False)
    root = pick(logits[None])  # (1,): stays on the device, it is the next input
    stats.passes = 1
    out = []
    while True:
        token = root.item()  # the one host sync per step
        if token == eot:
            break
        out.append(token)
        if on_tokens:
            on_tokens([token])
        if len(out) >= max_new_tokens:
            break
        L = cache.length
        if L == T:  # sliding window: rebuild from the last T // 2 tokens
            ctx = ctx[-(T // 2):]
            _prefill(model, ctx, cache, positions, with_streams=False)
            stats.passes += 1
            L = cache.length
        logits, _ = model.forward_nodes(root.view(1, 1), positions[L:L + 1], cache=cache, streams=False)
        cache.accept(1)
        ctx.append(token)
        root = pick(logits[0])
        stats.passes += 1
        stats.accepted.append(1)
    stats.new_tokens, stats.seconds = len(out), time.perf_counter() - t0
    return out, stats


def _walk(ys, tokens, children):
    """Verify: from the root, follow the child that carries the target's token y."""
    path, u = [0], 0
    while True:
        y = ys[u]
        for c in children[u]:
            if tokens[c] == y:
                break
        else:
            return path, y
        path.append(c)
        u = c


class _StaticMasks:
    """Masks of a fixed tree shape, built once per depth cut with block_size all-True
    prefix columns in front; a step with L cached tokens takes a view of the last L."""

    def __init__(self, tree, n_streams, block_size, device):
        self.tree, self.g, self.T, self.device, self.by_n = tree, n_streams, block_size, device, {}

    def at(self, n, L):
        if n not in self.by_n:
            mask = tree_mask(self.tree.parents[:n], self.T).to(self.device)
            depths = torch.tensor(self.tree.depths[:n], device=self.device)
            children = [[c for c in ch if c < n] for ch in self.tree.children[:n]]  # a depth cut drops nodes
            self.by_n[n] = (mask, stream_mask(mask, self.g) if self.g else None, depths, children)
        mask, smask, depths, children = self.by_n[n]
        return mask[:, self.T - L:], smask[:, self.T - L:] if smask is not None else None, depths, children


@torch.inference_mode()
def generate_speculative(model, prompt, max_new_tokens, tree, temperature=0.0, top_k=None, top_p=None, seed=None,
                         eot=None, on_tokens=None, prune_threshold=0.0):
    """Speculative Streaming: each forward pass verifies a tree draft and drafts the next one.

    prune_threshold > 0: parallel tree pruning (ss_mini/pruning.py) inside each pass."""
    cfg = model.config
    if prune_threshold and not cfg.prune_adapter_rank:
        raise ValueError("prune_threshold needs a model trained with a pruning adapter (--prune_adapter_rank=8)")
    if cfg.n_drafts == 0:
        raise ValueError("this model has no speculative streams (n_streams=0): train one with --n_streams=3, "
                         "or decode without --speculative")
    t0 = time.perf_counter()
    ctx = _prepare(model, prompt, max_new_tokens)
    T, dev = cfg.block_size, model.lm_head.weight.device
    cache = KVCache(cfg, T + len(tree), device=dev, dtype=model.lm_head.weight.dtype)  # + tentative slots
    positions = torch.arange(T + len(tree), device=dev)
    pick = Picker(temperature, top_k, top_p, seed, dev)
    masks = _StaticMasks(tree, cfg.n_streams, T, dev) if tree.static else None
    stats = Stats()
    logits, q = _prefill(model, ctx, cache, positions, with_streams=True)
    root = pick(logits[None])
    stats.passes = 1
    out = [root.item()]
    if out[0] == eot:
        out = []
    elif on_tokens:
        on_tokens(out)
    while out and out[-1] != eot and len(out) < max_new_tokens:
        L = cache.length
        if L == T:  # sliding window, the same rule as generate_ar
            ctx = ctx[-(T // 2):]
            _, q = _prefill(model, ctx, cache, positions, with_streams=True)
            stats.passes += 1
            L = cache.length
        max_depth = T - 1 - L  # positions stay < block_size
        # 1. tree draft
        if tree.static:
            tokens_t, n = tree.draft(root, q, max_depth)
            mask, smask, depths, children = masks.at(n, L)
        else:
            tokens, parents, depths_l, children = tree.draft(root, q, max_depth)
            n = len(tokens)
            tokens_t = torch.tensor(tokens, device=dev)
            mask = tree_mask(parents, L).to(dev)
            smask = stream_mask(mask, cfg.n_streams) if cfg.n_streams else None
            depths = torch.tensor(depths_l, device=dev)
        # 2. one forward pass: verify all nodes, draft from all nodes
        if prune_threshold:  # ... with the unlikely nodes dropped half-way (paper §3.2.3)
            h = model.forward_bottom(tokens_t[None], depths + L, mask, cache)
            parents = tree.parents[:n] if tree.static else parents
            h, mask, kept = prune_tree(model, h, tokens_t, parents, mask, cache, prune_threshold)
            if len(kept) < n:
                index_of = {u: i for i, u in enumerate(kept)}
                children = [[index_of[c] for c in children[u] if c in index_of] for u in kept]
                tokens_t, smask, n = tokens_t[torch.tensor(kept, device=dev)], None, len(kept)
                if not tree.static:
                    tokens = [tokens[u] for u in kept]
            logits, streams = model.forward_top(h, mask, cache=cache, smask=smask)
        else:
            logits, streams = model.forward_nodes(tokens_t[None], depths + L, mask, cache=cache, smask=smask)
        ys_t = pick(logits[0])
        # 3. verify (the one host sync of the step)
        if tree.static:
            ys, tokens = torch.stack([ys_t, tokens_t]).tolist()
        else:
            ys = ys_t.tolist()
        path, y = _walk(ys, tokens, children)
        # 4. accept: compact the cache, the last node's streams draft the next step
        a = len(path)
        cache.accept(a if path[-1] == a - 1 else torch.tensor(path, device=dev))
        ctx.extend(tokens[i] for i in path)
        q, root = streams[0, path[-1]], ys_t[path[-1]:path[-1] + 1]
        stats.passes += 1
        stats.accepted.append(a)
        stats.nodes.append(n)
        new = [tokens[i] for i in path[1:]] + [y]
        if eot is not None and eot in new:
            new = new[:new.index(eot) + 1]
        new = new[:max_new_tokens - len(out)]
        out.extend(new)
        if on_tokens:
            on_tokens([t for t in new if t != eot])
    if out and out[-1] == eot:
        out.pop()
    stats.new_tokens, stats.seconds = len(out), time.perf_counter() - t0
    return out, stats
