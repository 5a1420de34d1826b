"""Tree drafts (paper §3.2.2): which draft tokens one forward pass verifies.

The streams of the last accepted token give gamma distributions q_1..q_gamma over the
tokens at depths 1..gamma after the root r (the next token, already decided). A tree
draft puts r at depth 0 and, at depth j, candidates from q_j. The candidates of each
depth come *ranked* from the sampling rule (generate.py: the top-K tokens of q_j when
greedy, a sample without replacement when sampling), and every node is (depth, rank):
the children of a node always hold ranks 0..m-1 of the next depth.

Every tree is a fixed *template* of nodes in topological order (a parent before its
children) and, at each step, a choice of n of them for each row of the batch:
- `CartesianTree(ks)`: the paper's tree, every node at depth j-1 gets the top-k_j
  candidates of depth j: 1 + k_1 + k_1 k_2 + ... nodes; the template is the tree, and
  every row takes all of it.
- `BudgetTree(n)`: the n nodes with the largest product of draft probabilities along
  their path, always containing the top-1 chain. The template holds every path that can
  be among the best n (a child or a next sibling is never more probable than its node, so
  the best n are closed under "parent of" and "previous sibling of"); each step scores the
  template on the device and keeps the n best, a different shape in every row.
So a pass always carries n nodes per row, and a shape is data, never read by the host
(`TreeShape`): the tensors that the pass, verify and accept need, one row per batch row
(a Cartesian tree's rows are all alike and built once per batch size; a budget tree's
differ and are made at every step, on the device).

A tree bound to a model knows how many depths it drafts (`draft_depth`: its depth, at most
gamma): its passes run that many streams, since deeper ones would draft tokens no node holds.
"""
import itertools
import math

import torch

from .masks import attention_window, pass_mask, tree_mask

MAX_NODES = 256  # a pass carries n * (1 + gamma) rows; the paper's trees have tens of nodes


class TreeShape:
    """One step's tree in every row of a batch of B, as tensors on the device (n nodes, D the
    tree's depth). What the pass needs: depth (B, n), 0 for the root, j for a candidate of q_j;
    window (B, 1, R, 2S), its attention mask (masks.py). What verify needs: parent (B, n),
    the root pointing to itself; anc (B, n, n), v an ancestor of u or u itself, the root left
    out (always accepted); path_length (B, n) = depth + 1; and for speculative sampling tries
    (B, n, width), 1.0 where node u has an (r+1)-th child, and cand_row, the depth of q its
    children come from. What accept needs: path (B, n, D+1), the nodes root..u, padded with u.
    gather (B, n-1): where each node after the root finds its token among the ranked
    candidates, (depth - 1) * width + rank."""

    def __init__(self, template, sel, n_streams, max_len, width):
        t = template
        B, n = sel.shape
        self.n_nodes, self.width = n, width
        self.sel = sel  # the template nodes of each row, (B, n), ascending: parents first
        self.first_node = torch.arange(B, device=sel.device) * n  # row b's first of the B * n
        self.depth, self.rank = t.depth[sel], t.rank[sel]
        self.path_length = self.depth + 1  # the tokens a row emits when u ends its path
        self.gather = t.gather[sel][:, 1:]
        inv = torch.zeros(B, t.size, dtype=torch.long, device=sel.device)  # template -> here
        inv.scatter_(1, sel, torch.arange(n, device=sel.device).expand(B, n))
        self.parent = inv.gather(1, t.parent[sel])
        self.path = inv.gather(1, t.path[sel].flatten(1)).view(B, n, -1)
        anc = t.anc[sel[:, :, None], sel[:, None, :]]
        self.anc = anc.clone()
        self.anc[:, :, 0] = False
        ones = torch.ones(B, n - 1, device=sel.device)
        children = torch.zeros(B, n, device=sel.device).scatter_add_(1, self.parent[:, 1:], ones)
        self.tries = (torch.arange(width, device=sel.device) < children[..., None]).float()
        self.max_children = min(width, t.max_children)
        self.cand_row = self.depth.clamp(max=max(n_streams, 1) - 1)
        self.window = attention_window(pass_mask(anc, n_streams), max_len, t.dtype)


class Template:
    """A tree's template: every node it may use, as (rank at depth 1, rank at depth 2, ...)
    paths in topological order, with the tensors that every shape gathers from."""

    def __init__(self, paths, width, device, dtype):
        index = {p: i for i, p in enumerate(paths)}
        self.size, self.dtype = len(paths), dtype
        parent = [0] + [index[p[:-1]] for p in paths[1:]]
        ranks = [0] + [p[-1] for p in paths[1:]]
        depths = [len(p) for p in paths]
        D = max(depths)
        self.max_children = max([r + 1 for r in ranks[1:]], default=0)  # ranks 0..m-1
        on_path = [[index[p[:j]] for j in range(len(p) + 1)] for p in paths]  # root..u
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
        self.parent, self.depth, self.rank = t(parent), t(depths), t(ranks)
        self.gather = t([0] + [(len(p) - 1) * width + p[-1] for p in paths[1:]])
        self.path = t([nodes + [u] * (D + 1 - len(nodes)) for u, nodes in enumerate(on_path)])
        self.anc = tree_mask([-1] + parent[1:]).to(device)  # u's ancestors and u (masks.py)
        self.anc_t = self.anc.T.float()  # a budget tree sums log q along paths, in float32
        self.on_chain = ~(self.anc & (self.rank != 0)).any(-1)  # the top-1 chain's nodes


class _Tree:
    """What both trees share: binding to a model, which builds the template."""

    def bind(self, config, device, dtype, batch_size=1):
        """Ready for a model (its streams, block size, vocabulary), a device, a dtype and a
        batch size: builds the template once, and a Cartesian tree's shape per batch size."""
        if len(self) > MAX_NODES:
            raise ValueError(f"tree {self} has {len(self)} nodes; use at most {MAX_NODES}")
        # the depths it drafts, so the streams a pass runs: at least one, to draft the next pass
        draft_depth = max(1, min(self.max_depth, config.n_drafts))
        width = min(self.max_width, config.vocab_size)  # candidates ranked per depth
        device = torch.empty(0, device=device).device  # "cuda" is cuda:0: one device, one key
        key = (draft_depth, config.block_size, str(device), dtype, width)
        if getattr(self, "_key", None) != key:
            self._key, self.draft_depth, self.width = key, draft_depth, width
            # the cache's slots: the accepted tokens, then a pass's rows
            self.max_len = config.block_size + len(self) * (1 + draft_depth)
            paths = self.paths(min(self.max_depth, config.n_drafts), width)
            self.template = Template(paths, width, device, dtype)
            self.is_chain = self.template.max_children <= 1  # a path is then a prefix
            self.fixed = {}  # a Cartesian tree's one shape, per batch size
        if isinstance(self, CartesianTree):
            self.shape_for(batch_size)  # built here, outside a compiled step
        return self

    def __len__(self):
        return self.n_nodes

    def subshape(self, shape, kept):
        """The shape of a one-row shape's nodes `kept` (ascending, closed under parents)."""
        sel = shape.sel[:, kept]
        return TreeShape(self.template, sel, self.draft_depth, self.max_len, self.width)


class CartesianTree(_Tree):
    def __init__(self, ks):
        self.ks = tuple(int(k) for k in ks)
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"tree {ks!r}: give a top-k of at least 1 for each depth, e.g. 3,2,1")
        self.n_nodes = sum(math.prod(self.ks[:j]) for j in range(len(self.ks) + 1))
        if self.n_nodes > MAX_NODES:
            raise ValueError(f"tree {self} has {self.n_nodes} nodes; use at most {MAX_NODES}")
        self.max_width, self.max_depth = max(self.ks), len(self.ks)

    def bind(self, config, device, dtype, batch_size=1):
        if self.max_width > config.vocab_size:
            raise ValueError(f"tree {self} asks for the top {self.max_width} tokens of a depth, "
                             f"but the vocabulary has {config.vocab_size}")
        return super().bind(config, device, dtype, batch_size)

    def paths(self, depth, width):
        paths = [()]  # breadth-first, each node with its rank at every depth of its path
        for k in self.ks:
            paths += [p + (r,) for p in paths if len(p) == len(paths[-1]) for r in range(k)]
        return paths

    def shape(self, draft_logits, draft_probs=None, max_depth=None):
        """The same shape for every row and every step."""
        return self.shape_for(draft_logits.shape[0])

    def shape_for(self, batch_size):
        """The shape of a batch: built once per batch size (by `bind` for the decoders)."""
        if batch_size not in self.fixed:
            t = self.template
            sel = torch.arange(t.size, device=t.depth.device).expand(batch_size, -1)
            self.fixed[batch_size] = TreeShape(t, sel, self.draft_depth, self.max_len, self.width)
        return self.fixed[batch_size]

    def __repr__(self):
        return ",".join(map(str, self.ks))


class BudgetTree(_Tree):
    def __init__(self, n_nodes, n_streams):
        if n_nodes < 1:
            raise ValueError(f"a node budget of {n_nodes}: give at least 1 (the root)")
        self.n_nodes, self.n_streams = int(n_nodes), n_streams
        self.max_width = self.max_depth = max(1, self.n_nodes - 1)  # a chain of n is n - 1 deep

    def paths(self, depth, width):
        """Every path (rank at depth 1, rank at depth 2, ...) that can be among the best n with
        the top-1 chain: the paths it needs (prefixes, lower ranks) and the chain fit in n."""
        n, chain = self.n_nodes, min(depth, self.n_nodes - 1)

        def need(p):  # nodes that p brings with it: its prefixes' lower ranks, the chain's rest
            kin = sum(math.prod(r + 1 for r in p[:j]) for j in range(1, len(p) + 1))
            return 1 + kin + max(0, chain - len(p))

        out, level = [()], [()]
        for _ in range(depth):  # breadth-first; a path that needs too much has no cheaper child
            fits = lambda p: itertools.takewhile(lambda r: need(p + (r,)) <= n, range(width))
            level = [p + (r,) for p in level for r in fits(p)]
            out += level
        return out

    def shape(self, draft_logits, draft_probs=None, max_depth=None):
        """Each row's best n template nodes, scored by the product of draft probabilities along
        the path (ranks take the sorted probabilities of q; q is softmax(draft_logits) when greedy,
        the tempered, cut q that sampling draws from otherwise). The top-1 chain always comes
        first; nodes deeper than a row's max_depth (block_size) come last. A stable sort keeps
        template order among ties, so the n best are a tree: a parent before its children."""
        t = self.template
        q = torch.softmax(draft_logits.float(), -1) if draft_probs is None else draft_probs.float()
        top = torch.topk(q[:, :self.draft_depth], self.width, dim=-1).values
        logq = top.clamp_min(1e-30).log().flatten(1)
        step = logq[:, t.gather]  # (B, size): log q of each node's own (depth, rank)
        step[:, 0] = 0.0
        score = step @ t.anc_t  # log of the product along the path (anc includes u itself)
        score = score.masked_fill(t.on_chain, torch.inf)
        if max_depth is not None:
            score = score.masked_fill(t.depth > max_depth[:, None], -torch.inf)
        best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :self.n_nodes]
        sel = best.sort(dim=1).values
        return TreeShape(t, sel, self.draft_depth, self.max_len, self.width)

    def __repr__(self):
        return f"n{self.n_nodes}"


def tree_spec(tree):
    """The spec that makes this tree again: `make_tree(tree_spec(t), g)` (None: 'none')."""
    return "none" if tree is None else str(tree)


def make_tree(spec, n_streams):
    """'3,2,1' (Cartesian top-k per depth; '1' repeated = a chain), 'n16' (node budget),
    'chain' (the top-1 chain over all the model's streams: 1,1,1,1 for gamma = 4) or 'none'
    (no tree: plain decoding; None)."""
    spec = str(spec).strip()
    if spec == "none":
        return None
    if spec == "chain":
        return CartesianTree([1] * n_streams)
    try:
        if spec.startswith("n"):
            return BudgetTree(int(spec[1:]), n_streams)
        ks = [int(k) for k in spec.split(",")]
    except ValueError:
        raise ValueError(f"--tree={spec}: give top-k per depth (e.g. 3,2,1 or 1,1,1), a node "
                         "budget (e.g. n16), chain or none") from None
    if len(ks) > n_streams:
        raise ValueError(f"--tree={spec} has {len(ks)} depths, the model {n_streams} streams")
    return CartesianTree(ks)
