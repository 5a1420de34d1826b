"""The sampling rule of both decoders, in one place (`Sampler`): the next token, the ranked
draft candidates of each depth and the token the target emits at each tree node, greedy or
by speculative sampling (docs/sampling.md)."""
import torch


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
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # the mass before it reaches top_p
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _race(weights, u):
    """Keys of the exponential race, log(U) / w = -E / w with E = -log U ~ Exp(1) for uniform U (u):
    their argmax is a draw from the weights w (normalised or not), their top k in order a draw
    of k without replacement (Gumbel-top-k), and a token of weight 0 gets -inf, never drawn
    while another can be; no host sync (gpt-fast samples so). E comes as -log U because
    uniform_ and log_ are cheaper than exponential_ on a CPU (docs/step-cost.md)."""
    return u.clamp_min(torch.finfo(u.dtype).tiny).log() / weights  # U = 0 would give log 0


class Sampler:
    """The sampling rule of both decoders: `pick`, `draft` and `verify` (the module docstring).

    Greedy (temperature 0): argmax everywhere; the candidates are the top-k tokens of q_j.

    Sampling: speculative sampling on the tree (Leviathan et al. 2023, Chen et al. 2023; several
    children per node: SpecInfer, Miao et al. 2023; drafts without replacement: Jeon et al. 2024,
    "Recursive Speculative Decoding"). p is the target distribution at a node and q the draft
    distribution of the depth below it, both after the same temperature, top-k and top-p. The
    candidates of a depth are a sample from q without replacement, in order (Gumbel-top-k); a
    node's children hold ranks 0..m-1 of it. At a node the children are tried in rank order: child
    x is accepted with probability min(1, p(x)/q(x)); on rejection p becomes the residual
    norm(max(0, p - q)) and x is removed from q (renormalised), and the next child is tried; when
    none is left, the token is drawn from the residual. Each round emits a token distributed as its
    p, so the token at every node is distributed exactly as plain sampling's, whatever q is: the
    method stays lossless, and a draft is accepted with probability about 1 - TV(p, q) instead of
    p(x). A tree's shape must not depend on the sampled tokens, only on q (tree.py): a shape chosen
    by the sample would bias it. All draws come from one generator, in bulk, on the device
    (`uniform`).
    """

    def __init__(self, temperature, top_k, top_p, seed, device):
        if temperature < 0:
            raise ValueError(f"temperature={temperature}: give 0 (greedy) or more")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.gen = None
        if temperature > 0:
            self.gen = torch.Generator(device=device)
            if seed is None:
                self.gen.seed()  # a fresh seed, leaving torch's global generator as it is
            else:
                self.gen.manual_seed(seed)
        self.drawn = {}  # uniforms drawn ahead of a compiled step, by use

    def uniform(self, use, like):
        """Uniform draws shaped like `like` for one use in a step (`draw_ahead` lists them):
        taken from `draw_ahead`, or drawn now."""
        u = self.drawn.pop(use, None)
        if u is not None and u.shape != like.shape:
            raise RuntimeError(f"'{use}' draws made for {tuple(u.shape)} are used at "
                               f"{tuple(like.shape)}: Sampler.draw_ahead and the step disagree")
        return torch.rand(like.shape, generator=self.gen, device=like.device) if u is None else u

    def draw_ahead(self, batch_size, vocab_size, tree=None):
        """Every uniform draw of the next step, made before it (a compiled step cannot call the
        generator), by use. A plain step (tree None): 'pick' (B, V), the race of `pick`. A
        speculative step over n nodes: 'draft' (B, D, V), the race that ranks each depth's
        candidates; 'look' (B n, 1), a draft from the text tried first; 'verify' (B n, width),
        child r of each node accepted or not; 'residual' (B n, V), the draw where none is."""
        if self.gen is None:
            return
        B, V, n = batch_size, vocab_size, len(tree) if tree is not None else 0
        shapes = (dict(pick=(B, V)) if tree is None else
                  dict(draft=(B, tree.draft_depth, V), look=(B * n, 1),
                       verify=(B * n, tree.width), residual=(B * n, V)))
        self.drawn = {use: torch.rand(*shape, generator=self.gen, device=self.gen.device)
                      for use, shape in shapes.items()}

    def probs(self, logits):
        return target_probs(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits):  # (..., V) -> (...)
        if self.gen is None:
            return logits.argmax(-1)
        p = self.probs(logits)
        return _race(p, self.uniform("pick", p)).argmax(-1)

    def draft(self, draft_logits, width, exclude=None):
        """(ranked candidates (..., depths, width), draft probabilities (..., depths, V) or None
        when greedy) from draft logits (..., depths, V); exclude (..., 1, 1): q_1 leaves it out
        (-1: nothing left out)."""
        if exclude is not None:
            out, exclude = exclude >= 0, exclude.clamp_min(0)
            draft_logits = draft_logits.scatter(  # out of q_1: -inf; else its own logit
                -1, exclude, draft_logits.gather(-1, exclude).masked_fill(out, float("-inf")))
        if self.gen is None:
            return torch.topk(draft_logits, width, dim=-1).indices, None
        draft_probs = self.probs(draft_logits)
        keys = _race(draft_probs, self.uniform("draft", draft_probs))
        if exclude is not None:  # below even keys of -inf (past q_1's support): never drawn
            keys = keys.clamp_min(torch.finfo(keys.dtype).min)
            keys = keys.scatter(-1, exclude, keys.gather(-1, exclude).masked_fill(out, -torch.inf))
        return torch.topk(keys, width, dim=-1).indices, draft_probs

    def verify(self, main_logits, draft_probs, ranked, shape, look=None):
        """The token the target emits at each node (B, n): argmax, or speculative sampling (the
        class docstring; tests/test_verify.py `verify_reference`: one node at a time).
        main_logits (B, n, V) at the shape's nodes; draft_probs, ranked: from `draft`; look: the
        token from the text each node tries first, a point mass (-1: none; extras/lookup.py).

        Vectorised over the nodes of every row: in round r each node with an (r+1)-th child tries
        it, the others sit it out with q = 0 (`shape.has_child`), which leaves their p as it is;
        a node emits the first child it accepts. A candidate never drawn (q's support smaller than
        the width: the race ranks tokens with q(x) = 0 last) comes after all of the support, so
        by its round q is all zero: it is never accepted and leaves p as it is too."""
        if self.gen is None:
            return main_logits.argmax(-1)
        V, has_child = main_logits.shape[-1], shape.has_child
        p = p_target = self.probs(main_logits).reshape(-1, V)
        tried = []  # (accepted, token) of each try in order: a node emits its first accepted
        if look is not None:  # a child from the text: a point mass, tried first
            has, y = look.reshape(-1, 1) >= 0, look.reshape(-1, 1).clamp_min(0)
            py = p.gather(1, y)
            tried.append((has & (self.uniform("look", y) < py), y))  # min(1, p(y) / 1)
            rest = p.scatter(1, y, 0.0)  # rejected: p without y, what q's candidates then face
            p = p_target = torch.where(has, rest / rest.sum(-1, keepdim=True).clamp_min(1e-30), p)
        if shape.max_children:  # q of each node's children and its candidates (child r: cand[:, r])
            q = draft_probs.reshape(-1, V).index_select(0, shape.q_row)
            cand = ranked.reshape(-1, ranked.shape[-1]).index_select(0, shape.q_row)
            u = self.uniform("verify", cand)
        for r in range(shape.max_children):
            x, q = cand[:, r:r + 1], q * has_child[:, r:r + 1]
            px, qx = p.gather(1, x), q.gather(1, x)
            tried.append((u[:, r:r + 1] * qx < torch.minimum(px, qx), x))  # never if q = 0
            # rejected: p becomes norm(max(0, p - q)) (q = 0: p stays); x leaves q, renormalised
            p = (p - q).clamp_min_(0)
            if r + 1 < shape.max_children:  # q by what is left (1 - q(x) cancels if q(x) ~ 1)
                p = p / p.sum(-1, keepdim=True).clamp_min_(1e-30)
                q = q.scatter(1, x, 0.0)
                q = q / q.sum(-1, keepdim=True).clamp_min_(1e-30)
        # none accepted: the residual's draw (1e-30 p_target: the draw where p ~ q left zeros)
        residual = torch.add(p, p_target, alpha=1e-30)
        ys = _race(residual, self.uniform("residual", p)).argmax(-1, keepdim=True)
        for accepted, x in reversed(tried):
            ys = torch.where(accepted, x, ys)
        return ys.view(main_logits.shape[:-1])
