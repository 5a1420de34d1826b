"""The two decoders: KV-cached autoregressive (`generate_ar`) and Speculative Streaming
(`generate_speculative`). Both return (new tokens, Stats) and call `on_tokens` with each
pass's tokens as soon as they are final. Each is a loop around one step function
(`ar_step`, `speculative_step`), which bench.py also times on its own; `compiled(model)`
gives both the same model with its forward pass compiled. `on_pass`, when given, receives
what each speculative pass drafted, verified and accepted (sample.py --trace, trace.py).

One speculative step (paper §3.2), `speculative_step`:
  1. tree draft: root r (the next token, already decided) plus candidates ranked per
     depth from the streams q_1..q_gamma of the last accepted token  -> tree.py, Sampler.draft
  2. one forward pass over the tree: the main stream verifies every node, and the
     streams of every node draft for the step after (as many streams as the tree is
     deep: the others would draft depths it never uses)             -> GPT.forward_nodes
     (optionally pruned half-way                                     -> pruning.py)
  3. verify: the token y_u the target emits at every node u (argmax when greedy;
     speculative sampling otherwise, see `Sampler`); walk from the root while a child
     carries y_u; the last y is the next root                       -> Sampler.verify, `walk`
  4. accept: keep the path's K/V in the cache (compaction); its last node's streams
     are the next drafts                                             -> kvcache.py, KVCache.accept
Greedy outputs are those of `generate_ar`, token for token up to float near-ties (a tree
pass multiplies other matrix shapes than a one-token pass, so two nearly equal logits can
swap; bench.py reports the share of identical outputs, and the tests check equality in
float64); sampled outputs follow exactly the distribution of plain sampling (lossless), but
not the same random draws.

Context longer than block_size: both decoders use the same sliding-window rule. When
the cache is full they rebuild it from the last block_size // 2 tokens (one prefill
pass) and go on; the tree is cut so that no position reaches block_size, so both
rebuild at the same token and greedy outputs stay identical.
"""
import copy
import time
import warnings
from dataclasses import dataclass, field

import torch

from .kernels import decoding_kernels
from .kvcache import KVCache
from .masks import attention_mask
from .pruning import pruned_pass


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


def _race(weights, gen):
    """Keys of the exponential race, log(U) / w = -E / w with E = -log U ~ Exp(1) drawn per entry:
    their argmax is a draw from the weights w (normalised or not), their top k in order a draw
    of k without replacement (Gumbel-top-k), and a token of weight 0 gets -inf, never drawn
    while another can be; no host sync (gpt-fast samples so). E comes as -log U because
    uniform_ and log_ are cheaper than exponential_ on a CPU (docs/step-cost.md)."""
    return torch.empty_like(weights).uniform_(generator=gen).log_() / weights


class Sampler:
    """The sampling rule, in one place: the next token (`pick`), the ranked draft candidates
    of each depth (`draft`) and the token the target emits at each tree node (`verify`).

    Greedy (temperature 0): argmax everywhere; the candidates are the top-k tokens of q_j.

    Sampling: speculative sampling on the tree (Leviathan et al. 2023, Chen et al. 2023;
    several children per node: SpecInfer, Miao et al. 2023; drafts without replacement:
    Jeon et al. 2024, "Recursive Speculative Decoding"). p is the target distribution at a
    node and q the draft distribution of the depth below it, both after the same
    temperature, top-k and top-p. The candidates of a depth are a sample from q without
    replacement, in order (Gumbel-top-k); a node's children hold ranks 0..m-1 of it. At a
    node the children are tried in rank order: child x is accepted with probability
    min(1, p(x)/q(x)); on rejection p becomes the residual norm(max(0, p - q)) and x is
    removed from q (renormalised), and the next child is tried; when none is left, the
    token is drawn from the residual. Each round emits a token distributed as its p, so
    the token at every node is distributed exactly as plain sampling's, whatever q is: the
    method stays lossless, and a draft is accepted with probability about 1 - TV(p, q)
    instead of p(x). A tree's shape must not depend on the sampled tokens, only on q
    (tree.py): a shape chosen by the sample would bias it. All draws come from one
    generator, in bulk, on the device.
    """

    def __init__(self, temperature, top_k, top_p, seed, device):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.gen = None
        if temperature > 0:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(seed if seed is not None else torch.seed())

    def probs(self, logits):
        return target_probs(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits):  # (n, V) -> (n,)
        return logits.argmax(-1) if self.gen is None else _race(self.probs(logits), self.gen).argmax(-1)

    def draft(self, draft_logits, width):
        """(ranked candidates (depths, width), draft probabilities (depths, V) or None when
        greedy) from the draft logits (depths, V) of the last accepted position."""
        if self.gen is None:
            return torch.topk(draft_logits, width, dim=-1).indices, None
        draft_probs = self.probs(draft_logits)
        return torch.topk(_race(draft_probs, self.gen), width, dim=-1).indices, draft_probs

    def verify(self, main_logits, draft_probs, ranked, shape):
        """The token the target emits at each node (n_nodes,): argmax, or speculative sampling
        (recursive rejection over the node's children; see the class docstring, and
        tests/test_generate.py `verify_reference` for the same rule one node at a time).

        Vectorised over the nodes: in round r every node that has an (r+1)-th child and has
        accepted none tries it; the others sit the round out with q = 0 (`shape.tries`), which
        leaves their p as it is. A candidate that was never drawn (q's support smaller than
        the width: the race ranks tokens with q(x) = 0 last) comes after every token of the
        support, so by its round q is all zero: it is never accepted and leaves p as it is too."""
        if self.gen is None:
            return main_logits.argmax(-1)
        p = p_target = self.probs(main_logits)  # (n_nodes, V)
        q = draft_probs.index_select(0, shape.cand_row)  # each node's draft distribution: that of its children's depth
        cand = ranked.index_select(0, shape.cand_row)  # (n_nodes, width): child r holds cand[:, r]
        u = torch.rand(cand.shape, generator=self.gen, device=cand.device, dtype=p.dtype)
        ys = torch.full_like(cand[:, :1], -1)  # (n_nodes, 1); -1: no child accepted (yet)
        for r in range(shape.max_children):
            x, q = cand[:, r:r + 1], q * shape.tries[:, r:r + 1]
            px, qx = p.gather(1, x), q.gather(1, x)
            accept = u[:, r:r + 1] * qx < torch.minimum(px, qx)  # probability min(1, p(x)/q(x)); never if q = 0
            ys = torch.where(accept, x, ys)
            p = (p - q).clamp_min_(0)  # rejected: p becomes the residual max(0, p - q) (q = 0: p stays) ...
            if r + 1 < shape.max_children:  # ... normalised; x leaves q, renormalised; accepted nodes are done
                p = p / p.sum(-1, keepdim=True).clamp_min_(1e-30)
                q = (q.scatter(1, x, 0.0) / (1 - qx).clamp_min_(1e-30)).masked_fill_(accept, 0.0)
        # none accepted: draw from the residual; where p ~ q made it underflow to all zeros, from p itself
        p = torch.where(p.sum(-1, keepdim=True) > 0, p, p_target)
        return torch.where(ys >= 0, ys, _race(p, self.gen).argmax(-1, keepdim=True)).view(-1)


def compiled(model):
    """The same model (shared weights) with its forward pass compiled by torch.compile, for
    both decoders. Dynamic shapes: the cache length and the node count vary from pass to
    pass, so after the first few passes one graph per kind of pass (prefill, one token,
    tree) serves them all. The first generations pay the compilation (about a minute on
    a CPU); `bench.py --compile=True` measures it against eager in the same run."""
    fast = copy.copy(model)  # a second view: the eager model stays usable beside it
    fast.forward_nodes = torch.compile(model.forward_nodes, dynamic=True)
    return fast


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


def _prefill(model, ctx, cache, n_drafts):
    """Fill the cache with ctx; return the last position's main logits (V,) and, unless
    n_drafts = 0, draft logits (n_drafts, V) (GPT.forward_nodes)."""
    cache.reset()
    n, dev, dtype = len(ctx), cache.kv.device, cache.kv.dtype
    idx = torch.tensor([ctx], dtype=torch.long, device=dev)
    mask = attention_mask(range(-1, n - 1), model.streams_in_pass(n_drafts), stream_idx=[n - 1], dtype=dtype, device=dev)
    main_logits, draft_hidden, draft_logits = model.forward_nodes(idx, torch.arange(n, device=dev), mask, cache=cache,
                                                                  stream_idx=[n - 1], n_drafts=n_drafts, last_only=True)
    cache.accept(n)
    if draft_logits is None and draft_hidden is not None:  # Medusa's heads
        draft_logits = model.draft_logits(draft_hidden)
    return main_logits[0, -1], (draft_logits[0, -1] if n_drafts != 0 else None)


def ar_step(model, cache, root, sampler, positions):
    """One autoregressive pass: cache the root (1,), return the token after it (1,)."""
    L = cache.length
    main_logits, _, _ = model.forward_nodes(root.view(1, 1), positions[L:L + 1], cache=cache, n_drafts=0)
    cache.accept(1)
    return sampler.pick(main_logits[0])


@decoding_kernels
@torch.inference_mode()
def generate_ar(model, prompt, max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=None, eot=None,
                on_tokens=None):
    """KV-cached autoregressive decoding: one token per forward pass (the baseline)."""
    t0 = time.perf_counter()
    ctx = _prepare(model, prompt, max_new_tokens)
    T, dev = model.config.block_size, model.lm_head.weight.device
    cache = KVCache(model.config, T, device=dev, dtype=model.lm_head.weight.dtype)
    positions = torch.arange(T, device=dev)
    sampler = Sampler(temperature, top_k, top_p, seed, dev)
    stats = Stats()
    main_logits, _ = _prefill(model, ctx, cache, n_drafts=0)
    root = sampler.pick(main_logits[None])  # (1,): stays on the device, it is the next input
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
        if cache.length == T:  # sliding window: rebuild from the last T // 2 tokens
            ctx = ctx[-(T // 2):]
            _prefill(model, ctx, cache, n_drafts=0)
            stats.passes += 1
        root = ar_step(model, cache, root, sampler, positions)
        ctx.append(token)
        stats.passes += 1
        stats.accepted.append(1)
    stats.new_tokens, stats.seconds = len(out), time.perf_counter() - t0
    return out, stats


def walk(ys, tokens, children):
    """Verify: from the root, follow the child that carries the target's token y; return
    the path (node indices, root first) and the token after it."""
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


def speculative_step(model, cache, root, draft_logits, tree, sampler, max_depth, prune_threshold=0.0, on_pass=None):
    """One forward pass of Speculative Streaming: verify the tree drafted from draft_logits, draft the next.

    root: (1,) the next token, decided but not yet cached; draft_logits: (tree.n_drafts, V) the
    streams' logits at the last accepted position. Returns (path, y, root, draft_logits,
    n_nodes): the path's tokens (root first), now cached; y, the token after them (the next
    root, also as a (1,) tensor); the next draft logits; the number of nodes verified.
    on_pass: called with what the pass drafted, verified and accepted (a dict; trace.py
    records it), or None.
    """
    L = cache.length
    # 1. tree draft: candidates ranked per depth, placed into the tree's shape
    ranked, draft_probs = sampler.draft(draft_logits, tree.width)
    shape = tree.shape(draft_logits, max_depth)
    tokens = shape.tokens(root, ranked)
    drafted_tokens, drafted_shape = tokens, shape  # the tree before pruning, for on_pass
    # 2. one forward pass: the main stream verifies every node, the streams of every node draft
    if prune_threshold:  # ... with the unlikely nodes dropped half-way (paper §3.2.3)
        tokens, shape, main_logits, draft_hidden, all_draft_logits = pruned_pass(model, tokens, shape, tree, cache,
                                                                                 prune_threshold)
    else:  # all_draft_logits: every node's, when the pass is small enough to get them in its LM head call
        main_logits, draft_hidden, all_draft_logits = model.forward_nodes(tokens[None], shape.depth + L, shape.mask(L),
                                                                          cache=cache, n_drafts=tree.n_drafts)
    # 3. verify: the token the target emits at every node; walk while a child carries it
    ys_t = sampler.verify(main_logits[0], draft_probs, ranked, shape)
    ys, toks = torch.stack([ys_t, tokens]).tolist()  # the one host sync of the step
    path, y = walk(ys, toks, shape.children)
    # 4. accept: keep the path's K/V; the streams of its last node draft the next step
    cache.accept(path)
    if on_pass is not None:
        on_pass(dict(cache_length=L, draft_logits=draft_logits, draft_probs=draft_probs, drafted_tokens=drafted_tokens,
                     drafted_shape=drafted_shape, tokens=toks, shape=shape, ys=ys, path=path, next_root=y,
                     n_drafts=tree.n_drafts))
    u = path[-1]
    next_draft_logits = model.draft_logits(draft_hidden[0, u]) if all_draft_logits is None else all_draft_logits[0, u]
    return [toks[i] for i in path], y, ys_t[u:u + 1], next_draft_logits, shape.n_nodes


@decoding_kernels
@torch.inference_mode()
def generate_speculative(model, prompt, max_new_tokens, tree, temperature=0.0, top_k=None, top_p=None, seed=None,
                         eot=None, on_tokens=None, prune_threshold=0.0, on_pass=None):
    """Speculative Streaming: each forward pass verifies a tree draft and drafts the next one.

    prune_threshold > 0: parallel tree pruning (ss_mini/pruning.py) inside each pass (greedy only).
    on_pass: called after each decode pass with what it did (see speculative_step; trace.py)."""
    cfg = model.config
    if prune_threshold and not cfg.prune_adapter_rank:
        raise ValueError("prune_threshold needs a model trained with a pruning adapter (--prune_adapter_rank=8)")
    if prune_threshold and temperature > 0:
        raise ValueError("parallel tree pruning is greedy only: it drops drafts by their tokens, which would bias "
                         "speculative sampling; use temperature=0 or prune_threshold=0")
    if cfg.n_drafts == 0:
        raise ValueError("this model has no speculative streams (n_streams=0): train one with --n_streams=3, "
                         "or decode without --speculative")
    t0 = time.perf_counter()
    ctx = _prepare(model, prompt, max_new_tokens)
    T, dev, dtype = cfg.block_size, model.lm_head.weight.device, model.lm_head.weight.dtype
    tree.bind(cfg, dev, dtype)
    cache = KVCache(cfg, T + len(tree) * (1 + cfg.n_streams), device=dev, dtype=dtype)  # + tentative slots
    sampler = Sampler(temperature, top_k, top_p, seed, dev)
    stats = Stats()
    main_logits, draft_logits = _prefill(model, ctx, cache, tree.n_drafts)
    root = sampler.pick(main_logits[None])
    stats.passes = 1
    out = [root.item()]
    if out[0] == eot:
        out = []
    elif on_tokens:
        on_tokens(out)
    while out and out[-1] != eot and len(out) < max_new_tokens:
        if cache.length == T:  # sliding window, the same rule as generate_ar
            ctx = ctx[-(T // 2):]
            _, draft_logits = _prefill(model, ctx, cache, tree.n_drafts)
            stats.passes += 1
        max_depth = T - 1 - cache.length  # positions stay < block_size
        path, y, root, draft_logits, n_nodes = speculative_step(model, cache, root, draft_logits, tree, sampler,
                                                                max_depth, prune_threshold, on_pass)
        ctx.extend(path)
        new = path[1:] + [y]  # the pass's tokens: the root was emitted by the pass before
        if eot is not None and eot in new:
            new = new[:new.index(eot) + 1]
        new = new[:max_new_tokens - len(out)]
        out.extend(new)
        stats.passes += 1
        stats.accepted.append(len(new))  # tau counts what a pass emitted, so a pass cut short counts less
        stats.nodes.append(n_nodes)
        if on_tokens:
            on_tokens([t for t in new if t != eot])
    if out and out[-1] == eot:
        out.pop()
    stats.new_tokens, stats.seconds = len(out), time.perf_counter() - t0
    return out, stats
