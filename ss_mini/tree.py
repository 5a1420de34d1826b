"""Tree drafts (paper §3.2.2): which draft tokens one forward pass verifies.

The streams of the last accepted token give q_1..q_gamma over the tokens at depths 1..gamma
after the root r (the next token, already decided). A tree draft puts r at depth 0 and, at
depth j, candidates of q_j, *ranked* by the sampling rule (sampling.py: the top tokens when
greedy, a sample without replacement otherwise): a node is (depth, rank), and the children
of a node hold ranks 0..m-1 of the next depth. Every tree is a fixed *template* of nodes,
depth-first (the top-1 chain first, after any lookup chain), and at each step n of them per row:
- `CartesianTree(ks)`: the paper's tree, top-k_j candidates under every node of depth j-1,
  1 + k_1 + k_1 k_2 + ... nodes; every row takes the whole template.
- `BudgetTree(n)` (extras/budget_tree.py): each row's n most probable nodes, a shape per row;
- `LookupTree(ks, m)` (extras/lookup.py): `ks` plus a chain of m tokens from the decoded
  text under the root, its nodes of rank -1 (not a rank of q), which carry no streams.
A shape (`TreeShape`) is tensors, never read by the host. A tree bound to a model drafts
`draft_depth` depths (its stream nodes' depth, at most gamma; 0 for a lookup chain alone),
and its passes run that many streams.
"""
import math

import torch

from .masks import attention_window, pass_mask, tree_mask

MAX_NODES = 256  # a pass carries up to n * (1 + gamma) rows; the paper's trees have tens of nodes


class TreeShape:
    """One step's tree in every row of a batch of B, as tensors on the device (n nodes, D the
    tree's depth). What the pass needs: depth (B, n), 0 for the root, j for a candidate of q_j;
    stream_idx (B, m), the nodes that carry streams (None: all; a draft from the text carries
    none); window (B, 1, R, 2S), its attention mask (masks.py). What verify needs: parent (B, n),
    the root pointing to itself; anc (B, n, n), v an ancestor of u or u itself, the root left out
    (always accepted); path_length (B, n) = depth + 1; and for speculative sampling tries
    (B * n, width), 1.0 where node u has an (r+1)-th child from q, and cand_row (B * n), the row
    of the drafts (B * depths drafted) its children come from. What accept needs: path
    (B, n, D+1), the nodes root..u, padded with u; stream_row (B * n), whose streams draft after
    u among the B * m: u's, its root's for a draft from the text (None: u's). gather (B, n-1):
    where nodes 1..n-1 find their tokens: (depth - 1) * width + rank, or past the candidates."""

    def __init__(self, t, sel, n_streams, max_len, width):  # t: the tree's Template
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
        self.anc = anc & (self.depth > 0).unsqueeze(1)  # the root left out
        ones = (self.rank[:, 1:] >= 0).float()  # children drafted by q
        children = torch.zeros(B, n, device=sel.device).scatter_add_(1, self.parent[:, 1:], ones)
        self.tries = (torch.arange(width, device=sel.device) < children.view(-1, 1)).float()
        self.max_children = min(width, t.max_children)
        g = max(n_streams, 1)  # the children of row b's node at depth d: q_{d+1}, row b * g + d
        rows = torch.arange(B, device=sel.device)[:, None]
        self.cand_row = (rows * g + self.depth.clamp(max=g - 1)).flatten()
        self.stream_idx = self.stream_row = None  # every node carries streams
        if n_streams and t.from_text:  # a LookupTree's fixed shape (indexing by `carries` syncs)
            carries = self.rank >= 0  # the root and the stream nodes
            self.stream_idx = torch.arange(n, device=sel.device).expand(B, n)[carries].view(B, -1)
            local = (carries.cumsum(1) - 1) * carries  # in its row: its own, or the root's (0)
            self.stream_row = (rows * self.stream_idx.shape[1] + local).flatten()
        self.window = attention_window(pass_mask(anc, n_streams, self.stream_idx), max_len, t.dtype)


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
        self.gather = t([0] + [(len(p) - 1) * width + p[-1] if p[-1] >= 0
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
            self.is_chain = self.template.is_chain
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
