"""The two decoders: KV-cached autoregressive (`generate_ar`) and Speculative Streaming
(`generate_speculative`). Both take one prompt or a batch of prompts of any lengths, return
(new tokens, Stats) and call `on_tokens` with each pass's tokens as soon as they are final.
Each is a loop around one step function (`ar_step`, `speculative_step`) over the rows of a
`Batch`; bench.py also times the steps on their own, and `compiled(model)` compiles each
step whole. `on_pass`, when given, receives what each speculative pass of one prompt
drafted, verified and accepted (sample.py --trace, trace.py).

One speculative step (paper §3.2), `speculative_step`, for every row of the batch at once:
  1. tree draft: root r (the next token, already decided) plus candidates ranked per
     depth from the streams q_1..q_gamma of the last accepted token  -> tree.py, sampling.py
  2. one forward pass over the tree: the main stream verifies every node, and the
     streams of every node draft for the step after (as many streams as the tree is
     deep: the others would draft depths it never uses)             -> GPT.forward_nodes
     (optionally pruned half-way                                     -> pruning.py)
  3. verify: the token y_u the target emits at every node u (argmax when greedy;
     speculative sampling otherwise, see sampling.py); a node is accepted when every node on
     its path holds the token its parent emitted; the deepest one ends the path, and its
     y is the next root                                              -> Sampler.verify
  4. accept: keep each row's path in its cache (compaction); the path's last node's
     streams are the next drafts                                     -> kvcache.py, KVCache.accept
The step's shapes do not change from step to step and it reads nothing back to the host;
the decoder reads the emitted tokens once per step.

Greedy outputs are those of `generate_ar`, token for token up to float near-ties (a tree
pass multiplies other matrix shapes than a one-token pass, so two nearly equal logits can
swap; bench.py reports the share of identical outputs, and the tests check equality in
float64); every row of a batch is its prompt decoded alone. Sampled outputs follow exactly
the distribution of plain sampling (lossless), but not the same random draws.

Context longer than block_size: both decoders use the same sliding-window rule, row by
row. When a row's cache is full it is rebuilt from the row's last block_size // 2 tokens
(one prefill pass) and decoding goes on; no node past block_size is ever accepted, so
both decoders rebuild at the same token and greedy outputs stay identical.
"""
import copy
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch._inductor import config as inductor_config
from torch.utils._pytree import tree_map

from .extras.kernels import decoding_kernels
from .kvcache import KVCache
from .masks import attention_window, stream_rows_mask
from .extras.pruning import pruned_pass
from .sampling import Sampler


@dataclass
class Stats:
    new_tokens: int = 0
    passes: int = 0  # forward passes of the batch, prefill and cache rebuilds included
    accepted: list = field(default_factory=list)  # tokens each row emitted per decode pass: accepted drafts + 1
    nodes: list = field(default_factory=list)  # tree nodes verified per decode pass (after pruning)
    seconds: float = 0.0
    row_seconds: list = field(default_factory=list)  # when each prompt's output was complete
    # the batch at full strength: tokens emitted, seconds and passes from the start until a row
    # finished with no prompt waiting for its place (one prompt alone: its whole decode)
    full_tokens: int = 0
    full_seconds: float = 0.0
    full_passes: int = 0

    @property
    def tokens_per_s(self):
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted(self):
        """Mean accepted length tau: tokens a row emits per decode pass, its accepted drafts + 1."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


def compiled(model):
    """The same model (shared weights) whose decoders run each step compiled whole: forward,
    verify and accept as one graph (torch.compile, fullgraph=True; the prefill stays eager).
    The step's shapes do not change from step to step, so a graph serves every step of a tree
    and a batch size: CUDA replays it as a CUDA graph (mode="reduce-overhead"); a CPU runs
    inductor's C++ wrapper, which leaves less Python around the kernels, with the weights frozen
    into the graph (constants, packed for the CPU's GEMM when it compiles: compile a trained
    model, not one that will still learn); MPS decodes eagerly. The first steps pay the
    compilation (seconds per tree and batch size on a CPU; bench.py prints it)."""
    fast = copy.copy(model)  # a second view: the eager model stays usable beside it
    fast.compile_steps = True
    return fast


_COMPILED = {}


def _guards_to_keep(guards):
    """Which of dynamo's checks a compiled CPU step keeps before each call: not those on the model's
    modules (most of them, and their cost shows in a small step; docs/static-step.md), but each
    weight's identity, so that a graph with frozen weights never serves another model."""
    return [not g.orig_guard.source.is_unspecialized_nn_module() or g.guard_type == "ID_MATCH" for g in guards]


def _step(model, step):
    """`step` (ar_step or speculative_step) as the decoders run it: compiled for a `compiled` model.
    dynamic=False: a static graph per tree and batch size (dynamo would otherwise make a size that
    changed symbolic, and compile again when a later step leaves the range it guarded)."""
    device = model.lm_head.weight.device.type
    if not getattr(model, "compile_steps", False) or device == "mps":
        return step
    if (step, device) not in _COMPILED:
        if device == "cuda":  # CUDA graphs: a replay writes its outputs into the same buffers, so keep copies
            graph = torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")

            def fn(*args, **kwargs):
                torch.compiler.cudagraph_mark_step_begin()
                return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, graph(*args, **kwargs))
        else:
            # one compile thread: a pool of compile workers left beside the decoder slows it on a few cores
            options = {"cpp_wrapper": True, "compile_threads": 1}
            if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # a torch that filters guards
                options["guard_filter_fn"] = _guards_to_keep
            graph = torch.compile(step, fullgraph=True, dynamic=False, options=options)

            def fn(*args, **kwargs):
                # freezing: the weights become constants of the graph, laid out once for the CPU's GEMM.
                # Dynamo reads the switch while it traces, before a compile's options apply: set it per call
                was, inductor_config.freezing = inductor_config.freezing, True
                try:
                    return graph(*args, **kwargs)
                finally:
                    inductor_config.freezing = was
        _COMPILED[step, device] = fn
    return _COMPILED[step, device]


def _prepare(model, prompts, max_new_tokens, cache_slots, batch_size=None):
    """The prompts as a list of token lists, and whether one prompt (a list of ints) was given.
    Long prompts keep their last block_size tokens; bad input is a one-line ValueError."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least 1 token")
    single = len(prompts) == 0 or not isinstance(prompts[0], (list, tuple))
    batch = [list(prompts)] if single else [list(p) for p in prompts]
    if not batch:
        raise ValueError("no prompts: give a token list, or a list of token lists")
    for i, p in enumerate(batch):
        if not p:
            where = "" if single else f" (prompt {i} of the batch)"
            raise ValueError(f"empty prompt{where}: give at least one token (e.g. a newline or end-of-text)")
    T = model.config.block_size
    for i, p in enumerate(batch):
        if len(p) > T:
            warnings.warn(f"prompt of {len(p)} tokens is longer than block_size={T}: keeping the last {T}")
            batch[i] = p[-T:]
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: decode at least 1 prompt at a time")
    w = model.lm_head.weight
    need = model.config.n_layer * 2 * min(len(batch), batch_size or len(batch)) * cache_slots * model.config.n_embd * w.element_size()
    free = _free_memory(w.device)
    if free is not None and need > free:
        raise ValueError(f"a batch of {len(batch)} rows needs a KV cache of {need / 2**30:.1f} GiB and {w.device} "
                         f"has {free / 2**30:.1f} GiB free: decode fewer prompts at once")
    return batch, single


def _free_memory(device):
    """Bytes free on the device (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return None


@torch.no_grad()
def _prefill(model, ctxs, draft_depth, cache_slots=None):
    """One pass over each row's context, right-padded to the longest (a row's padding comes
    after its tokens, where nothing real looks): a new cache with these rows, the main logits at
    each row's last token (B, V) and, unless draft_depth = 0, its draft logits (B, g, V).
    cache_slots: the new cache's size (None: the contexts' slots only, for rows that
    `KVCache.put_rows` copies into a batch's cache: the contexts and the last token's streams)."""
    cfg, w = model.config, model.lm_head.weight
    B, n = len(ctxs), max(map(len, ctxs))
    idx = torch.tensor([c + c[-1:] * (n - len(c)) for c in ctxs], device=w.device)
    last = torch.tensor([len(c) - 1 for c in ctxs], device=w.device)[:, None]  # (B, 1)
    g = model.streams_in_pass(draft_depth)
    cache_slots = cache_slots or n + g
    cache = KVCache(cfg, cache_slots, B, device=w.device, dtype=w.dtype)
    causal = torch.ones(n, n, dtype=torch.bool, device=w.device).tril().expand(B, n, n)
    window = attention_window(stream_rows_mask(causal, g, stream_idx=last), cache_slots, w.dtype)
    cache.read_to([0] * B, window.shape[2])  # attention over the pass's own slots only
    main_logits, draft_logits = model.forward_nodes(idx, torch.arange(n, device=w.device), cache.mask(window),
                                                    cache=cache, stream_idx=last, draft_depth=draft_depth, main_idx=last)
    cache.advance(last[:, 0] + 1)
    return cache, main_logits[:, 0], (draft_logits[:, 0].contiguous() if draft_logits is not None else None)


class Batch:
    """The rows being decoded, as both decoders share them: each row's context and output on
    the host, its cache row, its root and drafts on the device. At most max_rows prompts decode
    at once; a row that finishes (end-of-text, max_new_tokens) hands its place to the next
    prompt waiting (continuous batching: one prefill pass for the prompts that join), and when
    none waits it leaves, with its cache row. A row whose cache is full rebuilds it from its
    last block_size // 2 tokens (the sliding window of one sequence, row by row). With
    compiled steps a finished row rides along, its tokens dropped, until the batch is done:
    each new batch size would be a new graph (`_step`), whose compilation costs more than the
    drain's steps over the full batch."""

    def __init__(self, model, prompts, max_new_tokens, eot, on_tokens, draft_depth, cache_slots, sampler, max_rows=None):
        self.model, self.max_new, self.eot, self.on_tokens = model, max_new_tokens, eot, on_tokens
        self.draft_depth, self.sampler = draft_depth, sampler
        self.stats, self.t0 = Stats(passes=0, row_seconds=[0.0] * len(prompts)), time.perf_counter()
        self.ctx = [list(p) for p in prompts]  # each prompt's accepted tokens: what a rebuilt window holds
        self.out = [[] for _ in prompts]
        self.started = [self.t0] * len(prompts)  # when each prompt took a row
        self.queue = list(range(len(prompts)))  # prompts waiting for a row
        self.done = set()  # prompts whose output is complete (rows that still ride along: compiled steps)
        self.emitted = 0  # tokens emitted so far (end-of-text not counted)
        self.ride_along = getattr(model, "compile_steps", False)
        n = min(max_rows or len(prompts), len(prompts))
        self.rows, self.queue = self.queue[:n], self.queue[n:]  # the prompt in each row
        self.lengths = [len(self.ctx[b]) for b in self.rows]  # the host's copy of cache.length, from the tokens it emits
        self.out_root = [None] * n  # each row's root: the last token it emitted, cached by the next pass
        self.cache, logits, self.drafts = _prefill(model, [self.ctx[b] for b in self.rows], draft_depth, cache_slots)
        self.stats.passes = 1
        self.roots = sampler.pick(logits)  # the same roots on the device
        self.going = self.emit([[t] for t in self.roots.tolist()], cached=False)

    def emit(self, new, cached=True):
        """Each row's new tokens (a list per row: a pass's accepted drafts and the next root); the
        pass cached the previous root and the drafts (cached=False: a prefill's first roots).
        Rows that finish hand their place on or leave the batch, full caches are rebuilt.
        Returns False when every output is complete."""
        finished = False
        for i, (b, toks) in enumerate(zip(self.rows, new)):
            if not toks:  # a row that did not take part (a prompt joining beside it)
                continue
            if cached:
                self.ctx[b] += [self.out_root[i]] + toks[:-1]
                self.lengths[i] += len(toks)
            self.out_root[i] = toks[-1]
            if b in self.done:
                continue
            out = self.out[b]
            if self.eot in toks:
                toks = toks[:toks.index(self.eot) + 1]
            toks = toks[:self.max_new - len(out)]
            out += toks
            if cached:
                self.stats.accepted.append(len(toks))  # tau counts what a pass emitted: a pass cut short counts less
            shown = [t for t in toks if t != self.eot]
            self.emitted += len(shown)
            if self.on_tokens and shown:
                self.on_tokens(b, shown)
            if (out and out[-1] == self.eot) or len(out) >= self.max_new:
                self.stats.row_seconds[b] = time.perf_counter() - self.started[b]
                self.done.add(b)
                finished = True
        if finished:
            free = [i for i, b in enumerate(self.rows) if b in self.done]
            if len(free) > len(self.queue) and not self.stats.full_seconds:  # from here on, fewer rows decode
                st = self.stats
                st.full_tokens, st.full_seconds, st.full_passes = self.emitted, time.perf_counter() - self.t0, st.passes
            if self.queue:
                return self.join(free[:len(self.queue)])
            if len(self.done) == len(self.out):
                return False
            if not self.ride_along:  # (finished rows ride along a compiled step: one graph per batch size)
                self.leave([i for i, b in enumerate(self.rows) if b not in self.done])
        T = self.model.config.block_size
        if T in self.lengths:  # sliding window: rebuild these rows from their last T // 2 tokens (one pass)
            full = [i for i, L in enumerate(self.lengths) if L == T]
            for i in full:
                self.ctx[self.rows[i]] = self.ctx[self.rows[i]][-(T // 2):]
                self.lengths[i] = T // 2
            self._fill(full, _prefill(self.model, [self.ctx[self.rows[i]] for i in full], self.draft_depth))
        return True

    def leave(self, keep):
        """Only the rows `keep` (indices) go on: the others leave the batch, with their cache rows."""
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, dtype=torch.long, device=self.cache.length.device)
            self.cache.keep_rows(index)
            self.roots = self.roots[index]
            self.drafts = self.drafts[index] if self.drafts is not None else None
            self.rows, self.lengths = [self.rows[i] for i in keep], [self.lengths[i] for i in keep]
            self.out_root = [self.out_root[i] for i in keep]

    def join(self, free):
        """The next prompts waiting take the rows `free`: one prefill pass, then their first tokens."""
        for i in free:
            b = self.rows[i] = self.queue.pop(0)
            self.lengths[i], self.started[b] = len(self.ctx[b]), time.perf_counter()
        cache, logits, drafts = _prefill(self.model, [self.ctx[self.rows[i]] for i in free], self.draft_depth)
        self._fill(free, (cache, logits, drafts))
        roots = self.sampler.pick(logits)
        self.roots[torch.tensor(free, device=roots.device)] = roots
        new = [[t] for t in self.roots.tolist()]  # the others' roots are unchanged: emitting them again adds nothing
        return self.emit([new[i] if i in free else [] for i in range(len(new))], cached=False)

    def _fill(self, rows, prefilled):
        """Rows of the batch replaced by a prefill of their contexts (one pass)."""
        cache, _, drafts = prefilled
        index = torch.tensor(rows, device=cache.length.device)
        self.cache.put_rows(index, cache)
        if drafts is not None:
            self.drafts[index] = drafts
        self.stats.passes += 1

    def finish(self, single):
        """The outputs (end-of-text dropped) and the Stats."""
        outs = [o[:-1] if o and o[-1] == self.eot else o for o in self.out]
        self.stats.new_tokens = sum(map(len, outs))
        self.stats.seconds = time.perf_counter() - self.t0
        return (outs[0] if single else outs), self.stats


def ar_window(cache):
    """The attention window of a one-token pass: a row sees its prefix and itself (masks.py)."""
    one = torch.ones(1, 1, 1, dtype=torch.bool, device=cache.slot.device)
    return attention_window(one, cache.max_len, cache.kv[0].dtype)


def ar_step(model, cache, root, sampler, window):
    """One autoregressive pass over the batch: cache each row's root (B,), return the token after it (B,)."""
    main_logits, _ = model.forward_nodes(root[:, None], cache.length[:, None], cache.mask(window),
                                         cache=cache, draft_depth=0)
    cache.advance(1)
    return sampler.pick(main_logits[:, 0])


@decoding_kernels
@torch.inference_mode()
def generate_ar(model, prompts, max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=None, eot=None,
                on_tokens=None, batch_size=None):
    """KV-cached autoregressive decoding: one token per row per forward pass (the baseline).

    prompts: a token list, or a list of token lists of any lengths (a batch). Returns the new
    tokens (a list, or a list per prompt) and Stats. on_tokens(prompt index, tokens) gets each
    pass's tokens as soon as they are final. batch_size: at most this many prompts decode at
    once, the next taking the place of one that finishes (None: all at once)."""
    batch, single = _prepare(model, prompts, max_new_tokens, model.config.block_size, batch_size)
    sampler = Sampler(temperature, top_k, top_p, seed, model.lm_head.weight.device)
    rows = Batch(model, batch, max_new_tokens, eot, on_tokens, 0, model.config.block_size, sampler, batch_size)
    window = ar_window(rows.cache)
    step, V, go = _step(model, ar_step), model.config.vocab_size, rows.going
    while go:
        sampler.draw_ahead(pick=(len(rows.rows), V))
        rows.cache.read_to(rows.lengths, 1)  # eager: attention over the slots in use only
        rows.roots = step(model, rows.cache, rows.roots, sampler, window)
        rows.stats.passes += 1
        go = rows.emit([[t] for t in rows.roots.tolist()])  # the one host sync per step
    return rows.finish(single)


def depth_limit(model, cache, lengths, depth):
    """max_depth of `speculative_step` for a tree `depth` deep over rows of these lengths (the
    host's copy of cache.length): the deepest node each row may accept, so that its positions stay
    below block_size, or None when no node reaches block_size (the step then skips that test). A
    compiled step always tests: a graph for each case would compile twice."""
    T = model.config.block_size
    if getattr(model, "compile_steps", False) or max(lengths) + depth >= T:
        return T - 1 - cache.length
    return None


def speculative_step(model, cache, root, draft_logits, tree, sampler, max_depth=None, prune_threshold=0.0):
    """One forward pass of Speculative Streaming over the batch: verify the tree drafted from
    draft_logits, draft the next. Everything stays on the device: no host sync.

    root: (B,) the next token of each row, decided but not yet cached; draft_logits: (B, D, V)
    the streams' logits at each row's last accepted position; max_depth (B,): the deepest node
    a row may accept (its positions stay < block_size; None: no node of this pass reaches
    block_size). Returns (emitted, root, draft_logits, pass): emitted (B, D+2) = [a, the
    target's tokens at the path's nodes (padded)] of each row, where a (1 to D+1) is the
    number of nodes it accepted: the pass emits a tokens, the path's a - 1 drafts and the next
    root; the next roots (B,); the next draft logits (B, D, V); and what the pass drafted,
    verified and accepted (a dict: trace.py).
    """
    T = model.config.block_size
    # 1. tree draft: candidates ranked per depth, placed into the tree's shape (per row for a budget tree)
    ranked, draft_probs = sampler.draft(draft_logits, tree.width)
    shape = tree.shape(draft_logits, draft_probs, max_depth)
    tokens = torch.cat([root.unsqueeze(1), ranked.flatten(1).gather(1, shape.gather)], dim=1)
    drafted = dict(tokens=tokens, shape=shape)
    # 2. one forward pass: the main stream verifies every node, the streams of every node draft
    if prune_threshold:  # ... with the unlikely nodes dropped half-way (paper §3.2.3)
        tokens, shape, main_logits, all_drafts = pruned_pass(model, tokens, shape, tree, cache, prune_threshold)
    else:
        positions = cache.length.unsqueeze(1) + shape.depth
        if max_depth is not None:  # nodes past block_size take its last position: they are never accepted
            positions = positions.clamp(max=T - 1)
        main_logits, all_drafts = model.forward_nodes(tokens, positions, cache.mask(shape.window), cache=cache,
                                                      draft_depth=tree.draft_depth)
    # 3. verify: the token the target emits at every node; a node is accepted when every node on
    # its path carries the token its parent emitted (children hold distinct tokens: one per depth)
    ys = sampler.verify(main_logits, draft_probs, ranked, shape)
    miss = tokens != ys.gather(1, shape.parent)
    if max_depth is not None:
        miss |= shape.depth > max_depth.unsqueeze(1)
    accepted = shape.path_length.masked_fill((shape.anc & miss.unsqueeze(1)).any(-1), 0)
    # the deepest accepted node ends the path (one per depth at most), as an index into the batch's
    # nodes (B * n): index_select and take copy only the rows wanted (advanced indexing is slower)
    last = accepted.argmax(1) + shape.first_node
    accepted, root = accepted.take(last), ys.take(last)
    # 4. accept: keep each row's path in its cache; the streams of its last node draft the next step.
    # The target's tokens at the path's nodes are its accepted drafts, then the next root: in a
    # chain the path of a nodes is nodes 0..a-1, already in place in the cache and in ys
    if tree.is_chain:
        cache.advance(accepted)
        on_path = ys
    else:
        path = shape.path.flatten(0, 1).index_select(0, last)
        cache.accept(path, accepted)
        on_path = ys.gather(1, path)
    emitted = torch.cat([accepted.unsqueeze(1), on_path], dim=1)
    step = dict(drafted=drafted, tokens=tokens, shape=shape, ys=ys, last=last, draft_probs=draft_probs)
    return emitted, root, all_drafts.flatten(0, 1).index_select(0, last), step


def _on_pass(on_pass, L, draft_logits, step, a, root, draft_depth):
    """Hand one pass of a single sequence to on_pass as plain lists (trace.py)."""
    on_pass(dict(cache_length=L, draft_logits=draft_logits[0], draft_probs=None if step["draft_probs"] is None
                 else step["draft_probs"][0], drafted_tokens=step["drafted"]["tokens"][0],
                 drafted_shape=step["drafted"]["shape"].host(), tokens=step["tokens"][0].tolist(),
                 shape=step["shape"].host(), ys=step["ys"][0].tolist(),
                 path=step["shape"].path.flatten(0, 1)[int(step["last"][0])][:a].tolist(),  # last: a flat node index
                 next_root=int(root[0]), draft_depth=draft_depth))


@decoding_kernels
@torch.inference_mode()
def generate_speculative(model, prompts, max_new_tokens, tree, temperature=0.0, top_k=None, top_p=None, seed=None,
                         eot=None, on_tokens=None, prune_threshold=0.0, on_pass=None, batch_size=None):
    """Speculative Streaming: each forward pass verifies a tree draft and drafts the next one.

    prompts, on_tokens, batch_size and the result: as `generate_ar`. prune_threshold > 0: parallel tree
    pruning (ss_mini/extras/pruning.py) inside each pass (greedy, one prompt). on_pass: called after
    each decode pass of a single prompt with what it did (trace.py)."""
    cfg = model.config
    if prune_threshold and not cfg.prune_adapter_rank:
        raise ValueError("prune_threshold needs a model trained with a pruning adapter (--prune_adapter_rank=8)")
    if prune_threshold and temperature > 0:
        raise ValueError("parallel tree pruning is greedy only: it drops drafts by their tokens, which would bias "
                         "speculative sampling; use temperature=0 or prune_threshold=0")
    if cfg.n_drafts == 0:
        raise ValueError("this model has no speculative streams (n_streams=0): train one with --n_streams=3, "
                         "or decode without --speculative")
    dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    tree.bind(cfg, dev, dtype)
    batch, single = _prepare(model, prompts, max_new_tokens, tree.max_len, batch_size)
    if prune_threshold and len(batch) > 1:
        raise ValueError("parallel tree pruning decodes one prompt at a time: give one prompt, or prune_threshold=0")
    if on_pass and len(batch) > 1:
        raise ValueError("on_pass records the passes of one prompt: give one prompt")
    sampler = Sampler(temperature, top_k, top_p, seed, dev)
    rows = Batch(model, batch, max_new_tokens, eot, on_tokens, tree.draft_depth, tree.max_len, sampler, batch_size)
    go = rows.going
    one_step, V, n, D = _step(model, speculative_step), cfg.vocab_size, len(tree), tree.draft_depth
    pass_rows = n * (1 + model.streams_in_pass(D))  # a pass writes its nodes' and their streams' keys
    while go:
        B = len(rows.rows)
        sampler.draw_ahead(draft=(B, D, V), verify=(B * n, tree.width), residual=(B * n, V))
        rows.cache.read_to(rows.lengths, pass_rows)  # eager: attention over the slots in use only
        L, draft_logits = rows.lengths[0], rows.drafts
        max_depth = depth_limit(model, rows.cache, rows.lengths, D)
        emitted, rows.roots, rows.drafts, step = one_step(
            model, rows.cache, rows.roots, draft_logits, tree, sampler, max_depth, prune_threshold)
        emitted = emitted.tolist()  # the one host sync per step
        rows.stats.passes += 1
        rows.stats.nodes.append(step["shape"].n_nodes)
        if on_pass is not None:
            _on_pass(on_pass, L, draft_logits, step, emitted[0][0], rows.roots, tree.draft_depth)
        go = rows.emit([row[1:1 + row[0]] for row in emitted])
    return rows.finish(single)
