"""Tree drafts (paper §3.2.2): which draft tokens one forward pass verifies.

The streams of the last accepted token give q_1..q_gamma over the tokens at depths 1..gamma
after the root r (the next token, already decided). A tree draft puts r at depth 0 and, at
depth j, candidates of q_j *ranked* by the sampling rule (sampling.py): a node is (depth, rank),
and the children of a node hold ranks 0..m-1 of the next depth. Every tree is a fixed
*template* of nodes, depth-first (the top-1 chain first, after any lookup chain), and at each
step n of them per row, a `TreeShape` of tensors: the paper's `CartesianTree(ks)` takes the
whole template; `BudgetTree(n)` (extras/budget_tree.py) each row's n most probable nodes;
`LookupTree(ks, m)` (extras/lookup.py) adds a chain of m tokens from the decoded text, its
nodes of rank -1, which carry no streams. A tree bound to a model drafts `draft_depth` depths
(at most gamma; 0 for a lookup chain alone), and its passes run that many streams.
"""
import math

import torch

from .masks import attention_window, pass_mask, tree_mask

MAX_NODES = 256  # a pass carries up to n * (1 + gamma) rows; the paper's trees have tens of nodes


class TreeShape:
    """One step's tree in every row of a batch of B, as tensors on the device: n nodes, the
    template's nodes `sel` (B, n) (parents first), D deep; node u of row b is node b * n + u of
    the batch (`first_node`). Worked through for the tree 2,1+L2: docs/step.md.

    The draft (step.py, draft_tree): token_index (B, n-1), where nodes 1..n-1 find their tokens
      among the ranked candidates ((depth - 1) * width + rank), or after them (the text's).
    The pass (forward_tree): depth (B, n), 0 for the root, j for a candidate of q_j (position
      L + depth); stream_idx (B, m), the nodes that carry streams (None: all; a draft from the
      text carries none); window (B, 1, R, 2S), the pass's mask (masks.py), R = n + m D rows.
    Verify: parent (B, n), the root its own; anc (B, n, n), v is u or an ancestor of u, the root
      left out (always accepted); path_length (B, n) = depth + 1, the tokens a row emits when
      its path ends at u; sampling, has_child (B n, width), 1.0 where u has an (r+1)-th child
      from q, and q_row (B n), the row of the draft distributions (B D) its children come from.
    Accept: path (B, n, D + 1), the nodes root..u, padded with u; next_draft_row (B n), the
      stream rows (of the B m) that draft after u: u's own, its root's for a draft from the
      text (None: u's)."""

    def __init__(self, t, sel, draft_depth, max_len, width):  # t: the tree's Template
        (B, n), device = sel.shape, sel.device
        self.n_nodes, self.width, self.sel = n, width, sel
        self.first_node = torch.arange(B, device=device) * n
        self.depth, self.rank = t.depth[sel], t.rank[sel]
        self.token_index = t.token_index[sel][:, 1:]
        # a template node's index among this shape's nodes, to renumber parents and paths
        here = torch.zeros(B, t.size, dtype=torch.long, device=device)
        here.scatter_(1, sel, torch.arange(n, device=device).expand(B, n))
        self.parent = here.gather(1, t.parent[sel])
        self.path = here.gather(1, t.path[sel].flatten(1)).view(B, n, -1)
        anc = t.anc[sel[:, :, None], sel[:, None, :]]
        self.anc = anc & (self.depth > 0).unsqueeze(1)  # the root left out
        self.path_length = self.depth + 1
        from_q = (self.rank[:, 1:] >= 0).float()  # children drafted by q (not by the text)
        children = torch.zeros(B, n, device=device).scatter_add_(1, self.parent[:, 1:], from_q)
        self.has_child = (torch.arange(width, device=device) < children.view(-1, 1)).float()
        self.max_children = min(width, t.max_children)
        g = max(draft_depth, 1)  # the children of row b's node at depth d: q_{d+1}, row b g + d
        rows = torch.arange(B, device=device)[:, None]
        self.q_row = (rows * g + self.depth.clamp(max=g - 1)).flatten()
        self.stream_idx = self.next_draft_row = None  # every node carries streams
        if draft_depth and t.from_text:  # a LookupTree's fixed shape (indexing by `carries` syncs)
            carries = self.rank >= 0  # the root and the stream nodes
            self.stream_idx = torch.arange(n, device=device).expand(B, n)[carries].view(B, -1)
            own = (carries.cumsum(1) - 1) * carries  # among its row's m: its own, or the root's
            self.next_draft_row = (rows * self.stream_idx.shape[1] + own).flatten()
        mask = pass_mask(anc, draft_depth, self.stream_idx)
        self.window = attention_window(mask, max_len, t.dtype)


class Template:
    """A tree's template: every node it may use, as (rank at depth 1, rank at depth 2, ...)
    paths in topological order, with the tensors that every shape gathers from. Rank -1 is a
    draft from the text: its token comes after the ranked candidates of n_ranked depths."""

    def __init__(self, paths, width, n_ranked, device, dtype):
        index = {p: i for i, p in enumerate(paths)}
        self.size, self.dtype = len(paths), dtype
        parent = [0] + [index[p[:-1]] for p in paths[1:]]
        ranks = [0] + [p[-1] for p in paths[1:]]
        depths = [len(p) for p in paths]
        D = max(depths)
        self.max_children = max([r + 1 for r in ranks[1:]], default=0)  # ranks 0..m-1
        self.is_chain = parent[1:] == list(range(len(paths) - 1))  # a path is then a prefix
        self.from_text = min(ranks) < 0  # drafts from the text, rank -1
        on_path = [[index[p[:j]] for j in range(len(p) + 1)] for p in paths]  # root..u
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
        self.parent, self.depth, self.rank = t(parent), t(depths), t(ranks)
        self.token_index = t([0] + [(len(p) - 1) * width + p[-1] if p[-1] >= 0
                               else n_ranked * width + len(p) - 1 for p in paths[1:]])
        self.path = t([nodes + [u] * (D + 1 - len(nodes)) for u, nodes in enumerate(on_path)])
        self.anc = tree_mask([-1] + parent[1:]).to(device)  # u's ancestors and u (masks.py)


class Tree:
    """What both trees share: binding to a model, which builds the template."""

    def bind(self, config, device, dtype, batch_size=1):
        """Ready for a model (its streams, block size, vocabulary), a device, a dtype and a
        batch size: builds the template once, and a Cartesian tree's shape per batch size."""
        if len(self) > MAX_NODES:
            raise ValueError(f"tree {self} has {len(self)} nodes; use at most {MAX_NODES}")
        # the depths it drafts, so the streams a pass runs (none: a tree without stream nodes)
        draft_depth = min(self.max_depth, config.n_drafts)
        width = min(self.max_width, config.vocab_size)  # candidates ranked per depth
        device = torch.empty(0, device=device).device  # "cuda" is cuda:0: one device, one key
        key = (draft_depth, config.block_size, str(device), dtype, width)
        if getattr(self, "_key", None) != key:
            self._key, self.draft_depth, self.width = key, draft_depth, width
            # the cache's slots: the accepted tokens, then a pass's rows (text drafts: no streams)
            carriers = len(self) - self.lookup_length
            self.max_len = config.block_size + len(self) + carriers * draft_depth
            paths = self.paths(draft_depth, width)
            self.template = Template(paths, width, draft_depth, device, dtype)
            self.fixed = {}  # a Cartesian tree's one shape, per batch size
        if isinstance(self, CartesianTree):
            self.shape_for(batch_size)  # built here, outside a compiled step
        return self

    lookup_length = 0  # tokens drafted from the decoded text (extras/lookup.py)

    def __len__(self):
        return self.n_nodes


class CartesianTree(Tree):
    def __init__(self, ks):
        self.ks = tuple(int(k) for k in ks)
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"tree {ks!r}: give a top-k of at least 1 for each depth, e.g. 3,2,1")
        self.n_nodes = sum(math.prod(self.ks[:j]) for j in range(len(self.ks) + 1))
        self.max_width, self.max_depth = max(self.ks), len(self.ks)

    def bind(self, config, device, dtype, batch_size=1):
        if len(self.ks) > config.n_drafts:
            raise ValueError(f"tree {self} has {len(self.ks)} depths, the model drafts "
                             f"{config.n_drafts}")
        if self.max_width > config.vocab_size:
            raise ValueError(f"tree {self} asks for the top {self.max_width} tokens of a depth, "
                             f"but the vocabulary has {config.vocab_size}")
        return super().bind(config, device, dtype, batch_size)

    def paths(self, depth, width):
        paths = [()]  # each node as its rank at every depth of its path
        for k in self.ks:
            paths += [p + (r,) for p in paths if len(p) == len(paths[-1]) for r in range(k)]
        return sorted(paths)  # depth-first: the top-1 chain first, its paths prefixes of the pass

    def shape(self, draft_logits, draft_probs=None, depth_limit=None):
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
