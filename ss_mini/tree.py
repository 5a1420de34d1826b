"""Tree drafts (paper §3.2.2): which draft tokens one forward pass verifies.

The streams of the last accepted token give gamma distributions q_1..q_gamma over the
tokens at depths 1..gamma after the root r (the next token, already decided). A tree
draft puts r at depth 0 and, at depth j, candidate tokens from q_j. Trees are flat
arrays in topological order (a parent before its children), so that a depth limit
is a prefix of the nodes:

    tokens[n]    token of each node (tokens[0] = r)
    parents[n]   index of the parent, -1 for the root
    depths[n]    0 for the root, j for a draft from stream j
    children[n]  child indices, for the walk of the verifier

Two shapes:
- `CartesianTree(ks)`: the paper's tree, every node at depth j-1 gets the top-k_j
  tokens of q_j: 1 + k_1 + k_1 k_2 + ... nodes. Its shape is fixed, so its masks are
  built once.
- `BudgetTree(n)`: the n nodes with the largest product of stream probabilities
  along their path, always containing the top-1 chain; its shape follows the drafts.
"""
import heapq
import itertools

import torch


class CartesianTree:
    def __init__(self, ks):
        self.ks = tuple(int(k) for k in ks)
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"tree {ks!r}: give a top-k of at least 1 for each depth, e.g. 3,2,1")
        # nodes in breadth-first order, each with its rank at every depth of its path
        paths = [()]
        for k in self.ks:
            paths += [p + (r,) for p in paths if len(p) == len(paths[-1]) for r in range(k)]
        index = {p: i for i, p in enumerate(paths)}
        self.parents = [-1] + [index[p[:-1]] for p in paths[1:]]
        self.depths = [len(p) for p in paths]
        self.children = [[] for _ in paths]
        for i, p in enumerate(self.parents[1:], 1):
            self.children[p].append(i)
        kmax = max(self.ks)
        # node (depth j, rank r at depth j) takes the token at flat index (j-1)*kmax + r of topk(q, kmax)
        self.gather = torch.tensor([(len(p) - 1) * kmax + p[-1] for p in paths[1:]], dtype=torch.long)
        self.n_at_depth = [sum(1 for d in self.depths if d <= j) for j in range(len(self.ks) + 1)]
        self.static = True

    def __len__(self):
        return len(self.parents)

    def draft(self, root, q, max_depth):
        """root: (1,) token tensor; q: (gamma, V) stream logits. Returns (tokens, n) with the
        first n nodes (those at depth <= max_depth)."""
        n = self.n_at_depth[min(max_depth, len(self.ks))]
        if self.gather.device != q.device:
            self.gather = self.gather.to(q.device)
        drafts = torch.topk(q[:len(self.ks)], max(self.ks), dim=-1).indices.view(-1)
        return torch.cat([root, drafts[self.gather[:n - 1]]]), n

    def __repr__(self):
        return ",".join(map(str, self.ks))


class BudgetTree:
    def __init__(self, n_nodes, n_streams):
        if n_nodes < 1:
            raise ValueError(f"a node budget of {n_nodes}: give at least 1 (the root)")
        self.n_nodes, self.n_streams, self.static = int(n_nodes), n_streams, False

    def __len__(self):
        return self.n_nodes

    def draft(self, root, q, max_depth):
        """Best-first search over paths (rank at depth 1, rank at depth 2, ...) of the
        top-(n-1) tokens per stream: a child or the next sibling of a chosen node is
        never more probable than it, so popping from a heap yields the best paths in
        order. Returns python lists (tokens, parents, depths, children)."""
        n, D = self.n_nodes, min(max_depth, self.n_streams)
        k = min(n - 1, q.shape[-1])
        if n == 1 or D == 0:
            return [int(root)], [-1], [0], [[]]
        top = torch.topk(torch.softmax(q[:D].float(), dim=-1), k, dim=-1)
        probs, toks = top.values.tolist(), top.indices.tolist()
        tokens, parents, depths, children, score = [int(root)], [-1], [0], [[]], [1.0]

        def add(parent, rank):
            d = depths[parent] + 1
            tokens.append(toks[d - 1][rank])
            parents.append(parent)
            depths.append(d)
            children.append([])
            children[parent].append(len(tokens) - 1)
            score.append(score[parent] * probs[d - 1][rank])
            return len(tokens) - 1

        frontier, tie = [], itertools.count()

        def push(parent, rank):  # candidate: child of `parent` with this rank at the next depth
            if depths[parent] < D and rank < k:
                heapq.heappush(frontier, (-score[parent] * probs[depths[parent]][rank], next(tie), parent, rank))

        node = 0  # the top-1 chain first, so the budget always holds the greedy guess
        while len(tokens) < n and depths[node] < D:
            node = add(node, 0)
            push(parents[node], 1)
        push(node, 0)
        while len(tokens) < n and frontier:
            _, _, parent, rank = heapq.heappop(frontier)
            node = add(parent, rank)
            push(parent, rank + 1)
            push(node, 0)
        return tokens, parents, depths, children

    def __repr__(self):
        return f"n{self.n_nodes}"


def make_tree(spec, n_streams):
    """'3,2,1' (Cartesian top-k per depth; '1' repeated = a chain) or 'n16' (node budget)."""
    spec = str(spec).strip()
    try:
        if spec.startswith("n"):
            return BudgetTree(int(spec[1:]), n_streams)
        ks = [int(k) for k in spec.split(",")]
    except ValueError:
        raise ValueError(f"--tree={spec}: give top-k per depth (e.g. 3,2,1 or 1,1,1) or a node budget (e.g. n16)") from None
    if len(ks) > n_streams:
        raise ValueError(f"--tree={spec} has {len(ks)} depths but the model has {n_streams} streams")
    return CartesianTree(ks)
