"""Budget trees: each row's n most probable nodes, chosen on the device at every step.

`BudgetTree(n)` keeps the n nodes with the largest product of draft probabilities along their
path, the top-1 chain always in. Its template (tree.py) holds every path that can be among
the best n (a child or a next sibling is never more probable than its node, so the best n
are closed under "parent of" and "previous sibling of"); each step scores the template and
keeps the n best: a different shape in every row, and still n nodes in every pass.
"""
import itertools
import math

import torch

from ..tree import Tree, TreeShape


class BudgetTree(Tree):
    def __init__(self, n_nodes):
        if n_nodes < 1:
            raise ValueError(f"a node budget of {n_nodes}: give at least 1 (the root)")
        self.n_nodes = int(n_nodes)
        self.max_width = self.max_depth = max(1, self.n_nodes - 1)  # a chain of n is n - 1 deep

    def bind(self, config, device, dtype, batch_size=1):
        super().bind(config, device, dtype, batch_size)
        t = self.template
        if getattr(self, "_scored", None) is not t:  # once per template
            self._scored = t
            self.anc_t = t.anc.T.float()  # scores sum log q along each path, in float32
            self.on_chain = ~(t.anc & (t.rank != 0)).any(-1)  # the top-1 chain's nodes
        return self

    def paths(self, depth, width):
        """Every path (rank at depth 1, rank at depth 2, ...) that can be among the best n with
        the top-1 chain: the paths it needs (prefixes, lower ranks) and the chain fit in n."""
        n, chain = self.n_nodes, min(depth, self.n_nodes - 1)

        def need(p):  # nodes that p brings with it: its prefixes' lower ranks, the chain's rest
            kin = sum(math.prod(r + 1 for r in p[:j]) for j in range(1, len(p) + 1))
            return 1 + kin + max(0, chain - len(p))

        out, level = [()], [()]
        for _ in range(depth):  # a path that needs too much has no cheaper child
            fits = lambda p: itertools.takewhile(lambda r: need(p + (r,)) <= n, range(width))
            level = [p + (r,) for p in level for r in fits(p)]
            out += level
        return sorted(out)  # depth-first, as CartesianTree's: the top-1 chain first

    def shape(self, draft_logits, draft_probs=None, depth_limit=None):
        """Each row's best n template nodes, scored by the product of draft probabilities along
        the path (ranks take the sorted probabilities of q; q is softmax(draft_logits) when greedy,
        the tempered, cut q that sampling draws from otherwise). The top-1 chain is always chosen,
        nodes deeper than a row's depth_limit (block_size) last. A stable sort keeps template
        order among ties, so the n best are a tree: a parent before its children."""
        t = self.template
        q = torch.softmax(draft_logits.float(), -1) if draft_probs is None else draft_probs.float()
        top = torch.topk(q[:, :self.draft_depth], self.width, dim=-1).values
        logq = top.clamp_min(1e-30).log().flatten(1)
        step = logq[:, t.token_index]  # (B, size): log q of each node's own (depth, rank)
        step[:, 0] = 0.0
        score = step @ self.anc_t  # log of the product along the path (anc includes u itself)
        score = score.masked_fill(self.on_chain, torch.inf)
        if depth_limit is not None:
            score = score.masked_fill(t.depth > depth_limit[:, None], -torch.inf)
        best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :self.n_nodes]
        sel = best.sort(dim=1).values
        return TreeShape(t, sel, self.draft_depth, self.max_len, self.width)

    def __repr__(self):
        return f"n{self.n_nodes}"
