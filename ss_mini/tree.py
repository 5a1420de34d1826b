"""Tree drafts (paper §3.2.2): which draft tokens one forward pass verifies.

The streams of the last accepted token give gamma distributions q_1..q_gamma over the
tokens at depths 1..gamma after the root r (the next token, already decided). A tree
draft puts r at depth 0 and, at depth j, candidates from q_j. The candidates of each
depth come *ranked* from the sampling rule (generate.py: the top-K tokens of q_j when
greedy, a sample without replacement when sampling), and every node is (depth, rank):
the children of a node always hold ranks 0..m-1 of the next depth. A tree's *shape*
(`TreeShape`) is flat arrays in topological order (a parent before its children), so
that a depth limit is a prefix of the nodes:

    parents[n]   index of the parent, -1 for the root
    depths[n]    0 for the root, j for a candidate from stream j
    ranks[n]     rank of the node's token among the candidates of its depth
    children[n]  child indices, for the walk of the verifier

Two shapes, one interface (`tree.shape(draft_logits, max_depth)` -> TreeShape):
- `CartesianTree(ks)`: the paper's tree, every node at depth j-1 gets the top-k_j
  candidates of depth j: 1 + k_1 + k_1 k_2 + ... nodes, always the same shape.
- `BudgetTree(n)`: the n nodes with the largest product of stream probabilities along
  their path (ranks scored by the sorted probabilities of q), always containing the
  top-1 chain; its shape follows the drafts, and each shape met is kept for reuse.
A shape carries what the pass needs on the device, built once: the node depths, the
gather index into the ranked candidates and the attention mask in SDPA's additive form,
with block_size prefix columns, so a step with L cached tokens takes a view. A tree
bound to a model knows how many depths it drafts (`n_drafts`: its depth, at most gamma):
its passes run that many streams, since deeper ones would draft tokens no node holds.
"""
import heapq
import itertools
import math

import torch

from .masks import attention_mask


class TreeShape:
    def __init__(self, parents, ranks, n_drafts, block_size, width, device, dtype):
        self.parents, self.ranks, self.n_nodes = list(parents), list(ranks), len(parents)
        self.depths, self.children = [0] * self.n_nodes, [[] for _ in parents]
        for i, p in enumerate(self.parents[1:], 1):
            self.depths[i] = self.depths[p] + 1
            self.children[p].append(i)
        self.depth = torch.tensor(self.depths, device=device)
        # node i > 0 takes the token at flat index (depth - 1) * width + rank of the ranked candidates
        self.gather = torch.tensor([(d - 1) * width + r for d, r in zip(self.depths[1:], self.ranks[1:])],
                                   dtype=torch.long, device=device)
        # for speculative sampling: which children a node tries, and the depth whose candidates they hold
        self.max_children = max(len(c) for c in self.children)
        self.tries = torch.tensor([[float(r < len(c)) for r in range(width)] for c in self.children],
                                  device=device)  # (n, width): 1.0 where node u has an (r+1)-th child
        self.cand_row = self.depth.clamp(max=n_drafts - 1)
        self.block_size = block_size
        self.full_mask = attention_mask(self.parents, n_drafts, block_size, dtype=dtype, device=device)

    def mask(self, L):
        """The attention mask of this tree after L cached tokens: a view, no work on a CPU. A GPU
        gets a copy: its fused attention kernels need the mask's memory aligned, and a view
        starts wherever L puts it."""
        mask = self.full_mask[:, self.block_size - L:]
        return mask if mask.device.type == "cpu" else mask.contiguous()

    def tokens(self, root, ranked):
        """The tree's tokens: the root (1,), then each node's candidate from ranked (depths, width)."""
        return torch.cat([root, ranked.reshape(-1)[self.gather]])


MAX_NODES = 256  # a tree pass carries n * (1 + gamma) rows; the paper's trees have tens of nodes
SHAPE_CACHE_BYTES = 64 << 20  # the masks of the shapes kept for reuse (a GPT-2-sized n32 mask is ~0.6 MB)


class _Tree:
    """What both shapes share: binding to a model (streams, block size, vocabulary), a device
    and a dtype, and the shapes built for them."""

    def bind(self, config, device, dtype):
        if len(self) > MAX_NODES:
            raise ValueError(f"tree {self} has {len(self)} nodes; use at most {MAX_NODES} (tens are typical)")
        # the depths it drafts: a pass runs that many streams (GPT.forward_nodes, n_drafts), and
        # at least one, so that every pass drafts for the next
        n_drafts = max(1, min(self.max_depth, config.n_drafts))
        key = (n_drafts, config.block_size, str(device), dtype)
        if getattr(self, "_key", None) != key or self.width != min(self.max_width, config.vocab_size):
            self._key, self._shapes, self._shape_bytes = key, {}, 0
            self.width = min(self.max_width, config.vocab_size)  # candidates ranked per depth
        self.n_drafts = n_drafts
        return self

    def shape_of(self, parents, ranks):
        """The TreeShape of these arrays, built once."""
        key = (tuple(parents), tuple(ranks))
        if key not in self._shapes:
            n_drafts, block_size, device, dtype = self._key
            shape = TreeShape(parents, ranks, n_drafts, block_size, self.width, device, dtype)
            size = shape.full_mask.numel() * shape.full_mask.element_size()
            if self._shape_bytes + size > SHAPE_CACHE_BYTES:  # a budget tree meets few shapes; bound them anyway
                self._shapes.clear()
                self._shape_bytes = 0
            self._shapes[key] = shape
            self._shape_bytes += size
        return self._shapes[key]


class CartesianTree(_Tree):
    def __init__(self, ks):
        self.ks = tuple(int(k) for k in ks)
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"tree {ks!r}: give a top-k of at least 1 for each depth, e.g. 3,2,1")
        n = sum(math.prod(self.ks[:j]) for j in range(len(self.ks) + 1))
        if n > MAX_NODES:
            raise ValueError(f"tree {self} has {n} nodes; use at most {MAX_NODES} (tens are typical)")
        paths = [()]  # nodes in breadth-first order, each with its rank at every depth of its path
        for k in self.ks:
            paths += [p + (r,) for p in paths if len(p) == len(paths[-1]) for r in range(k)]
        index = {p: i for i, p in enumerate(paths)}
        self.parents = [-1] + [index[p[:-1]] for p in paths[1:]]
        self.ranks = [0] + [p[-1] for p in paths[1:]]
        self.n_at_depth = [sum(1 for p in paths if len(p) <= j) for j in range(len(self.ks) + 1)]
        self.max_width, self.max_depth = max(self.ks), len(self.ks)

    def __len__(self):
        return len(self.parents)

    def bind(self, config, device, dtype):
        if self.max_width > config.vocab_size:
            raise ValueError(f"tree {self} asks for the top {self.max_width} tokens of a depth, but the vocabulary "
                             f"has {config.vocab_size}")
        return super().bind(config, device, dtype)

    def shape(self, draft_logits, max_depth):
        """The fixed shape, cut to the nodes at depth <= max_depth."""
        n = self.n_at_depth[min(max_depth, len(self.ks))]
        return self.shape_of(self.parents[:n], self.ranks[:n])

    def __repr__(self):
        return ",".join(map(str, self.ks))


class BudgetTree(_Tree):
    def __init__(self, n_nodes, n_streams):
        if n_nodes < 1:
            raise ValueError(f"a node budget of {n_nodes}: give at least 1 (the root)")
        self.n_nodes, self.n_streams = int(n_nodes), n_streams
        self.max_width = self.max_depth = max(1, self.n_nodes - 1)  # a chain of n nodes is n - 1 deep

    def __len__(self):
        return self.n_nodes

    def shape(self, draft_logits, max_depth):
        """Best-first search over paths (rank at depth 1, rank at depth 2, ...) scored by the
        sorted stream probabilities: a child or the next sibling of a chosen node is never
        more probable than it, so popping from a heap yields the best paths in order."""
        n, D, k = self.n_nodes, min(max_depth, self.n_streams), self.width
        if n <= D + 1:  # the budget holds the top-1 chain and no more: no search needed
            return self.shape_of(list(range(-1, n - 1)), [0] * n)
        probs = torch.topk(torch.softmax(draft_logits[:D].float(), dim=-1), k, dim=-1).values.tolist()
        parents, ranks, depths, score = [-1], [0], [0], [1.0]

        def add(parent, rank):
            parents.append(parent), ranks.append(rank), depths.append(depths[parent] + 1)
            score.append(score[parent] * probs[depths[-1] - 1][rank])
            return len(parents) - 1

        frontier, tie = [], itertools.count()

        def push(parent, rank):  # candidate: child of `parent` with this rank at the next depth
            if depths[parent] < D and rank < k:
                heapq.heappush(frontier, (-score[parent] * probs[depths[parent]][rank], next(tie), parent, rank))

        node = 0  # the top-1 chain first, so the budget always holds the greedy guess
        while len(parents) < n and depths[node] < D:
            node = add(node, 0)
            push(parents[node], 1)
        push(node, 0)
        while len(parents) < n and frontier:
            _, _, parent, rank = heapq.heappop(frontier)
            node = add(parent, rank)
            push(parent, rank + 1)
            push(node, 0)
        return self.shape_of(parents, ranks)

    def __repr__(self):
        return f"n{self.n_nodes}"


def make_tree(spec, n_streams):
    """'3,2,1' (Cartesian top-k per depth; '1' repeated = a chain), 'n16' (node budget) or
    'chain' (the top-1 chain over all the model's streams: 1,1,1,1 for gamma = 4)."""
    spec = str(spec).strip()
    if spec == "chain":
        return CartesianTree([1] * n_streams)
    try:
        if spec.startswith("n"):
            return BudgetTree(int(spec[1:]), n_streams)
        ks = [int(k) for k in spec.split(",")]
    except ValueError:
        raise ValueError(f"--tree={spec}: give top-k per depth (e.g. 3,2,1 or 1,1,1), a node budget (e.g. n16) "
                         "or chain") from None
    if len(ks) > n_streams:
        raise ValueError(f"--tree={spec} has {len(ks)} depths but the model has {n_streams} streams")
    return CartesianTree(ks)
