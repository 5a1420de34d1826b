"""The attention masks of Speculative Streaming: one rule for training and decoding.

A forward pass (model.py, `GPT.forward_nodes`) runs main *nodes* with parent pointers (a
chain in training, a tree draft when decoding) and, in the multi-stream attention
layers, the streams of some of them. Its mask comes from here: main rows see the cached
prefix, their ancestors and themselves (`tree_mask`), never a stream; stream j of a node
sees what its node sees plus the node's streams 1..j (`stream_mask`, paper Eq. 2);
`attention_mask` puts both into the one mask of one attention call.
"""
import numpy as np
import torch


def tree_mask(parents, prefix_len=0):
    """Attention mask of main nodes with parent pointers: the one mask builder.

    parents: sequence of ints, parents[i] < i, -1 for a root. Returns a bool tensor
    (n, prefix_len + n), True = may attend: node u sees the cached prefix, its
    ancestors and itself. A chain (parents = [-1, 0, 1, ...]) gives the causal mask
    of training. Streams see what their node sees plus their own lower streams
    (`stream_mask`).
    """
    parents = np.asarray(parents, dtype=np.int64).reshape(-1)
    n = len(parents)
    if np.any(parents >= np.arange(n)):
        raise ValueError("parents must point to earlier nodes (parents[i] < i)")
    anc = np.eye(n, dtype=bool)
    for i in np.flatnonzero(parents >= 0):  # row parents[i] is complete before row i
        anc[i] |= anc[parents[i]]
    return torch.from_numpy(np.pad(anc, ((0, 0), (prefix_len, 0)), constant_values=True))


def stream_mask(mask, n_streams, stream_idx=None):
    """Mask of the stream rows (Eq. 2), from the main mask (n, Lk) of `tree_mask`.

    Stream rows are ordered (node, j) for the nodes in stream_idx (None = all). Keys
    are [the Lk main keys; the stream rows]: stream (u, j) sees the main keys that u
    sees and the streams (u, i <= j). Returns a bool tensor (m*g, Lk + m*g).
    """
    rows = mask if stream_idx is None else mask[stream_idx]
    m, g = rows.shape[0], n_streams
    tril = torch.tril(torch.ones(g, g, dtype=torch.bool, device=rows.device))
    eye = torch.eye(m, dtype=torch.bool, device=rows.device)
    own = (eye[:, None, :, None] & tril[None, :, None, :]).reshape(m * g, m * g)
    return torch.cat([rows.repeat_interleave(g, dim=0), own], dim=1)


def attention_mask(parents, n_streams=0, prefix_len=0, stream_idx=None, dtype=torch.bool, device="cpu"):
    """The mask of one forward pass: rows [n main nodes; their streams], keys [cached prefix;
    n main nodes; the stream rows], so main and stream rows share one attention call.

    Main rows see what `tree_mask` allows and no stream (the main stream never attends to a
    stream); stream rows follow `stream_mask` (Eq. 2). dtype=torch.bool: True = may attend;
    a float dtype gives the additive form (0 or -inf) that SDPA uses without converting it on
    every call. stream_idx: the nodes that carry streams (None = all; [] = none).
    """
    main = tree_mask(parents, prefix_len)
    if n_streams and (stream_idx is None or len(stream_idx)):
        streams = stream_mask(main, n_streams, stream_idx)
        main = torch.cat([main, torch.zeros(main.shape[0], streams.shape[0], dtype=torch.bool)], dim=1)
        main = torch.cat([main, streams], dim=0)
    if dtype != torch.bool:
        main = torch.zeros(main.shape, dtype=dtype).masked_fill_(~main, float("-inf"))
    return main.to(device)


def stream_rows_mask(anc, n_streams, stream_idx=None):
    """The same rule on the device, for a batch of passes: anc (B, n, n) bool, u's ancestors and
    u itself (`tree_mask` without the prefix); the nodes with streams stream_idx (B, m) (None =
    all). Returns (B, R, R), R = n + m * n_streams: rows and keys [n main nodes; the stream rows]."""
    B, n, _ = anc.shape
    g = n_streams
    if not g:
        return anc
    rows = anc if stream_idx is None else anc.gather(1, stream_idx[..., None].expand(-1, -1, n))
    m = rows.shape[1]
    tril = torch.tril(torch.ones(g, g, dtype=torch.bool, device=anc.device))
    eye = torch.eye(m, dtype=torch.bool, device=anc.device)
    own = (eye[:, None, :, None] & tril[None, :, None, :]).reshape(m * g, m * g).expand(B, -1, -1)
    main = torch.cat([anc, anc.new_zeros(B, n, m * g)], dim=2)
    return torch.cat([main, torch.cat([rows.repeat_interleave(g, dim=1), own], dim=2)], dim=1)


def attention_window(local, max_len, dtype):
    """A pass's mask over its own rows, local (B, R, W) bool, made ready for a cache of max_len
    slots: (B, 1, R, 2 max_len) additive, [the prefix: all 0 | local | -inf]. A pass writes its
    rows at slots L, L+1, ... of a row whose cache holds L tokens, so that row's mask over the
    whole cache is this window cut at max_len - L (`KVCache.mask`): one gather, on the device."""
    B, R, W = local.shape
    add = torch.zeros(local.shape, dtype=dtype, device=local.device).masked_fill_(~local, float("-inf"))
    window = torch.cat([add.new_zeros(B, R, max_len), add, add.new_full((B, R, max_len - W), float("-inf"))], dim=2)
    return window.unsqueeze(1)

