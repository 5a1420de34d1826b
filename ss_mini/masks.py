"""The attention mask of a forward pass (paper Eq. 2): one rule, for training and decoding.

A pass runs main *nodes* with parent pointers (a chain when training, a tree draft when
decoding) and, in the top Ns layers, the streams of some of them. The rule:
- main node u sees the cached prefix, its ancestors and itself, never a stream (Eq. 1);
- stream (u, j) sees what u sees, plus the streams (u, i) for i <= j (Eq. 2).
`tree_mask` gives the ancestors from parent pointers, `pass_mask` adds the stream rows, and
`attention_window` lays a decoding pass's mask over the KV cache's slots.
"""
import torch


def tree_mask(parents):
    """(n, n) bool from parent pointers (parents[u] < u, -1 for the root): node u sees its
    ancestors and itself. A chain, parents = [-1, 0, 1, ...], gives the causal mask."""
    parents = list(parents)
    anc = torch.eye(len(parents), dtype=torch.bool)
    for u, p in enumerate(parents):
        if p >= u:
            raise ValueError("parents must point to earlier nodes (parents[u] < u)")
        if p >= 0:
            anc[u] |= anc[p]  # row p is complete before row u
    return anc


def pass_mask(anc, n_streams, stream_idx=None):
    """The mask of one pass over its own rows, (B, R, R) bool, True = may attend.

    anc (B, n, n): `tree_mask` of each row's nodes; stream_idx (B, m): the nodes that carry
    streams (None = all n). Rows and keys are [n main nodes; stream (u, j) for each such
    node u and j = 1..n_streams], R = n + m * n_streams."""
    (B, n, _), g = anc.shape, n_streams
    if not g:
        return anc
    node = anc if stream_idx is None else anc.gather(1, stream_idx[..., None].expand(-1, -1, n))
    m = node.shape[1]
    lower = torch.ones(g, g, dtype=torch.bool, device=anc.device).tril()  # stream i <= j
    same = torch.eye(m, dtype=torch.bool, device=anc.device)  # of the same node
    own = (same[:, None, :, None] & lower[None, :, None, :]).reshape(m * g, m * g)
    main = torch.cat([anc, anc.new_zeros(B, n, m * g)], dim=2)  # the main stream sees no stream
    streams = torch.cat([node.repeat_interleave(g, dim=1), own.expand(B, -1, -1)], dim=2)
    return torch.cat([main, streams], dim=1)


def attention_window(local, max_len, dtype):
    """A decoding pass's mask `local` (B, R, R) bool made ready for a cache of max_len slots:
    (B, 1, R, 2 max_len) additive, [the prefix: 0 | local | -inf]. A row holding L tokens
    writes the pass at slots L, L+1, ..., so its mask over the cache is this window from
    column max_len - L on (`KVCache.mask`): one gather on the device per pass."""
    B, R, W = local.shape
    add = torch.zeros_like(local, dtype=dtype).masked_fill_(~local, float("-inf"))
    prefix = add.new_zeros(B, R, max_len)
    rest = add.new_full((B, R, max_len - W), float("-inf"))
    return torch.cat([prefix, add, rest], dim=2).unsqueeze(1)
