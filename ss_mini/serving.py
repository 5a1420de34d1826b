"""Serving the rows of a batch around the decoders: prompts waiting, a finished row handing its
place to the next, the sliding window of a full row, the memory check, the statistics bench.py
reads. One prompt's step needs none of it: `Batch` is then a prefill and an output list.
"""
import time
import warnings
from dataclasses import dataclass, field

import torch

from .step import prefill


@dataclass
class Stats:
    new_tokens: int = 0
    passes: int = 0  # forward passes of the batch, prefill and cache rebuilds included
    accepted: list = field(default_factory=list)  # tokens a row emitted per decode pass
    from_text: list = field(default_factory=list)  # of them, accepted drafts from the text
    nodes: list = field(default_factory=list)  # tree nodes verified per decode pass
    seconds: float = 0.0
    row_seconds: list = field(default_factory=list)  # when each prompt's output was complete
    # at full strength: until a row finished with no prompt waiting (a lone prompt: all its decode)
    full_tokens: int = 0
    full_seconds: float = 0.0
    full_passes: int = 0

    @property
    def tokens_per_s(self):
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted(self):
        """tau: tokens a row emits per decode pass, its accepted drafts + 1."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


def prepare(model, prompts, max_new_tokens, batch_size=None):
    """(the prompts as a list of token lists, whether one prompt was given). A prompt is a list
    of ints or a 1-D tensor; a batch a list of them or a 2-D tensor. A prompt longer than
    block_size keeps what the sliding window would keep; bad input is a one-line ValueError."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() not in (1, 2):
            raise ValueError(f"prompts of shape {tuple(prompts.shape)}: give (T,) or (B, T)")
        prompts = prompts.tolist()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least 1 token")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: decode at least 1 prompt at a time")
    single = len(prompts) == 0 or not isinstance(prompts[0], (list, tuple, torch.Tensor))
    as_list = lambda p: p.tolist() if isinstance(p, torch.Tensor) else list(p)
    batch = [as_list(prompts)] if single else [as_list(p) for p in prompts]
    if not batch:
        raise ValueError("no prompts: give a token list, or a list of token lists")
    T = model.config.block_size
    for i, p in enumerate(batch):
        if not p:
            where = "" if single else f" (prompt {i} of the batch)"
            raise ValueError(f"empty prompt{where}: give at least one token (e.g. a newline)")
        if len(p) > T:
            warnings.warn(f"prompt of {len(p)} tokens is longer than block_size={T}: keeping "
                          f"its last {T // 2}, as the sliding window would")
            batch[i] = p[-(T // 2):]
    return batch, single


def check_memory(model, rows, cache_slots, pass_rows):
    """A one-line ValueError unless the device holds the KV cache of `rows` rows and a pass's
    masks over it (the attention window of 2 * cache_slots and the mask of cache_slots, per row
    of a pass: masks.py, kvcache.py), which outgrow the cache for trees of hundreds of nodes."""
    cfg, w = model.config, model.lm_head.weight
    need = rows * cache_slots * (cfg.n_layer * 2 * cfg.n_embd + 3 * pass_rows) * w.element_size()
    free = _free_memory(w.device)
    if free is not None and need > free:
        raise ValueError(f"a batch of {rows} rows needs {need / 2**30:.1f} GiB for its KV cache "
                         f"and masks and {w.device} has {free / 2**30:.1f} GiB free: decode "
                         "fewer at once")


def _free_memory(device):
    """Bytes free on the device (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return 1024 * next(int(line.split()[1]) for line in f if line.startswith("MemAvail"))
    except (OSError, StopIteration):
        return None


class Batch:
    """The rows being decoded: each row's context and output on the host, its cache row, root
    and drafts on the device. At most max_rows prompts decode at once; a row that finishes
    (end-of-text, max_new_tokens) hands its place to the next prompt waiting (one prefill pass
    for the prompts that join). When none waits, a finished row rides along, its tokens
    dropped, until every row is done: the batch keeps its size, so every step has the same
    shapes (one compiled graph). A row whose cache is full is rebuilt from its last
    block_size // 2 tokens (the sliding window of one sequence, row by row). clock: what
    Stats' seconds are read from (lab/lockstep.py gives each decoder its own)."""

    def __init__(self, model, prompts, max_new_tokens, eot, on_tokens, draft_depth, cache_slots,
                 sampler, max_rows=None, clock=time.perf_counter):
        self.model, self.max_new, self.eot, self.on_tokens = model, max_new_tokens, eot, on_tokens
        self.draft_depth, self.sampler, self.clock = draft_depth, sampler, clock
        self.t0 = clock()
        self.stats = Stats(passes=1, row_seconds=[0.0] * len(prompts))
        self.ctx = [list(p) for p in prompts]  # each prompt's accepted tokens
        self.out = [[] for _ in prompts]
        self.started = [self.t0] * len(prompts)  # when each prompt took a row
        self.done, self.emitted = set(), 0  # prompts complete; tokens emitted (not end-of-text)
        n = min(max_rows or len(prompts), len(prompts))
        self.prompt_of, self.queue = list(range(n)), list(range(n, len(prompts)))  # row -> prompt
        self.last_token = [None] * n  # each row's root: its last token, cached by the next pass
        self.cache, logits, self.drafts = prefill(model, [self.ctx[b] for b in self.prompt_of],
                                                  draft_depth, cache_slots)
        self.roots = sampler.pick(logits)  # the same roots, on the device
        self.going = self._emit([[t] for t in self.roots.tolist()], cached=False)

    def emit(self, new, n_nodes=0, chains=None):
        """A decode pass's new tokens, a list per row (its accepted drafts and the next root) of
        a pass over n_nodes tree nodes (0: a plain pass) and each row's lookup chain (None: no
        chain; a path that took the chain's first token took the chain, the streams never
        propose it); `going` is False when all is done."""
        self.stats.passes += 1
        self.stats.nodes += [n_nodes] if n_nodes else []
        text = [len(t) > 1 and t[0] == c[0] for t, c in zip(new, chains)] if chains else None
        self.going = self._emit(new, text=text)

    def _emit(self, new, cached=True, text=None):
        """The new tokens of each row; the pass cached the previous root and the drafts
        (cached=False: a prefill's roots). Finished rows hand their place on; full caches are
        rebuilt. False when all is done."""
        finished = False
        for i, (b, toks) in enumerate(zip(self.prompt_of, new)):
            if not toks:  # a row that did not take part (a prompt joining beside it)
                continue
            if cached:  # the cache's length is len(ctx[b]) on the host
                self.ctx[b] += [self.last_token[i]] + toks[:-1]
            self.last_token[i] = toks[-1]
            if b not in self.done:
                finished |= self._output(b, toks, cached, text and text[i])
        if finished:
            free = [i for i, b in enumerate(self.prompt_of) if b in self.done]
            if len(free) > len(self.queue) and not self.stats.full_seconds:  # fewer rows from now
                st = self.stats
                st.full_tokens, st.full_passes = self.emitted, st.passes
                st.full_seconds = self.clock() - self.t0
            if self.queue:
                return self.join(free[:len(self.queue)])
            if len(self.done) == len(self.out):
                return False
        self._slide()
        return True

    def _output(self, b, toks, cached, text=False):
        """Add a pass's tokens to prompt b's output (text: its drafts came from the text); True
        when it is complete."""
        out = self.out[b]
        if self.eot in toks:
            toks = toks[:toks.index(self.eot) + 1]
        toks = toks[:self.max_new - len(out)]
        out += toks
        if cached:  # a pass cut short counts what it emitted
            self.stats.accepted.append(len(toks))
            self.stats.from_text.append(len(toks) - 1 if text else 0)
        shown = [t for t in toks if t != self.eot]
        self.emitted += len(shown)
        if self.on_tokens and shown:
            self.on_tokens(b, shown)
        if (out and out[-1] == self.eot) or len(out) >= self.max_new:
            self.stats.row_seconds[b] = self.clock() - self.started[b]
            self.done.add(b)
            return True
        return False

    def _slide(self):
        """Rows whose cache is full keep their last block_size // 2 tokens (one prefill pass);
        a finished row riding along only moves back, its tokens being dropped anyway."""
        T = self.model.config.block_size
        full = [i for i, b in enumerate(self.prompt_of) if len(self.ctx[b]) == T]
        if not full:
            return
        for i in full:
            self.ctx[self.prompt_of[i]] = self.ctx[self.prompt_of[i]][-(T // 2):]
        live = [i for i in full if self.prompt_of[i] not in self.done]
        if len(live) < len(full):
            back = torch.zeros_like(self.cache.length)
            back[[i for i in full if i not in live]] = T // 2 - T
            self.cache.advance(back)
        if live:
            self._fill(live)

    def join(self, free):
        """The next prompts waiting take the rows `free`: one prefill pass, their first tokens."""
        for i in free:
            b = self.prompt_of[i] = self.queue.pop(0)
            self.started[b] = self.clock()
        logits = self._fill(free)
        roots = self.sampler.pick(logits)
        self.roots[torch.tensor(free, device=roots.device)] = roots
        new = [[t] for t in self.roots.tolist()]  # the others' roots: emitted already
        return self._emit([new[i] if i in free else [] for i in range(len(new))], cached=False)

    def _fill(self, rows):
        """Rows of the batch replaced by a prefill of their contexts (one pass); their logits."""
        cache, logits, drafts = prefill(self.model, [self.ctx[self.prompt_of[i]] for i in rows],
                                        self.draft_depth)
        index = torch.tensor(rows, device=cache.length.device)
        self.cache.put_rows(index, cache)
        self.drafts[index] = drafts
        self.stats.passes += 1
        return logits

    def contexts(self):
        """Each row's decoded tokens, its root last (drafts from the text: extras/lookup.py)."""
        return [self.ctx[b] + [t] for b, t in zip(self.prompt_of, self.last_token)]

    def finish(self, single):
        """The outputs (end-of-text dropped) and the Stats."""
        outs = [o[:-1] if o and o[-1] == self.eot else o for o in self.out]
        self.stats.new_tokens = sum(map(len, outs))
        self.stats.seconds = self.clock() - self.t0
        return (outs[0] if single else outs), self.stats
