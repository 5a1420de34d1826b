"""One row of a tree's TreeShape (tree.py) as plain lists, read on the host: what the trace
page draws and what the tests compare."""
import torch


class HostShape:
    """parents, depths, ranks, children and stream carriers of one row's nodes; `mask(L)`: the
    pass's mask over the cached prefix (its first L columns) and the pass's rows, as a bool
    tensor."""

    def __init__(self, shape, row=0):
        self.n_nodes = shape.n_nodes
        self.parents = [-1] + shape.parent[row, 1:].tolist()
        self.depths = shape.depth[row].tolist()
        self.ranks = shape.rank[row].tolist()
        # the nodes that carry streams, in the order of their stream rows (a draft from the text
        # carries none)
        self.streams = (list(range(self.n_nodes)) if shape.stream_idx is None
                        else shape.stream_idx[min(row, shape.stream_idx.shape[0] - 1)].tolist())
        self.children = [[] for _ in range(self.n_nodes)]
        for u, p in enumerate(self.parents[1:], 1):
            self.children[p].append(u)
        self._window = shape.window[min(row, shape.window.shape[0] - 1), 0]
        self._slots = shape.window.shape[-1] // 2

    def mask(self, L):
        local = self._window[:, self._slots:]
        R = local.shape[0]
        return torch.cat([torch.ones(R, L, dtype=torch.bool), local[:, :R].cpu() == 0], dim=1)


def host_shape(shape, row=0):
    return HostShape(shape, row)
