"""The KV cache of decoding: one preallocated tensor for all layers and a batch of rows, a
length per row, and the compaction of each row's accepted tree path (paper §3.2: accept)."""
import torch


class KVCache:
    """Preallocated keys/values of all layers for B rows, with a length L[b] per row (a tensor,
    on the device: the step never asks the host where to write).

    Row b holds its accepted tokens at slots 0..L[b]-1, with no padding before them (learned
    absolute positions would make left padding wrong). A pass over R rows (nodes and their
    stream rows) writes its K/V at slots L[b], L[b]+1, ... of each row, and attention reads all
    max_len slots with a mask that hides what a row must not see (`mask`, masks.py): the
    shapes never change from step to step. `accept` then keeps each row's own path at
    L[b]..L[b]+a[b]-1; slots past a row's length hold stale values that the next pass
    overwrites and the mask hides. Stream rows are never accepted: streams keep no cache of
    their own (Eq. 2: they read the main stream's). One tensor for all layers: compacting the
    accepted paths of every row is one gather and one scatter.
    """

    def __init__(self, config, max_len, batch_size=1, device="cpu", dtype=torch.float32):
        hd = config.n_embd // config.n_head
        self.kv = torch.zeros(config.n_layer, 2, batch_size, config.n_head, max_len, hd, device=device, dtype=dtype)
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slot = torch.arange(max_len, device=device)
        self._views()

    def _views(self):
        """Where each (row, head) starts when the cache is seen as one flat run of slots, so that a
        write by index copies whole vectors (index_copy_)."""
        n_layer, two, B, H, S, hd = self.kv.shape
        self.run = (torch.arange(B * H, device=self.kv.device) * S).view(B, H, 1)  # where each (row, head) starts
        self._where = None  # this pass's write index, made once per pass

    def _index(self, slots):
        """Flat indices of slots (B, R) in every head of their row: (B * H * R,)."""
        return (self.run + slots[:, None, :]).flatten()

    def write(self, layer, kv):
        """Store a pass's keys and values kv (2, B, H, R, hd) at slots L[b].. of each row; return
        the keys and values of all slots."""
        R = kv.shape[3]
        if self._where is None or self._where[0] != R:
            self._where = R, self._index(self.length[:, None] + self.slot[:R])
        kv_layer = self.kv[layer]
        kv_layer.view(2, -1, kv.shape[-1]).index_copy_(1, self._where[1], kv.reshape(2, -1, kv.shape[-1]))
        return kv_layer[0], kv_layer[1]

    def mask(self, window):
        """Each row's mask over all slots, (B, 1, R, S), from a pass's `attention_window`: slots
        < L[b] are the prefix, the pass sits at L[b].. (masks.py)."""
        R, S = window.shape[1], window.shape[2] // 2
        index = (S - self.length)[:, None, None] + self.slot
        return window.expand(len(self.length), -1, -1).gather(2, index.expand(-1, R, -1)).unsqueeze(1)

    def accept(self, path, accepted):
        """Keep each row's accepted nodes: the node path[b, i] of this pass moves to slot
        L[b] + i, and L[b] += accepted[b]. path (B, P) holds node indices, root first, padded
        past a row's accepted length with any node (those slots lie past the new length)."""
        flat = self.kv.view(-1, self.run.numel() * self.kv.shape[4], self.kv.shape[5])  # all layers' keys and values
        src = self._index(self.length[:, None] + path)
        flat.index_copy_(1, self._index(self.length[:, None] + self.slot[:path.shape[1]]), flat.index_select(1, src))
        self.advance(accepted)

    def advance(self, accepted):
        """L += accepted: the first accepted[b] rows of the pass are already in place (a chain)."""
        self.length += accepted
        self._where = None

    def rewind(self, length):
        """Every row back to `length` tokens (a benchmark repeats one step)."""
        self.length.fill_(length)
        self._where = None

    def keep_rows(self, rows):
        """Only these rows go on (the others finished): (B',) row indices."""
        self.kv, self.length = self.kv[:, :, rows], self.length[rows]
        self._views()

    def put_rows(self, rows, other):
        """Rows of this cache replaced by the rows of another (a rebuilt window)."""
        self.kv[:, :, rows] = other.kv
        self.length[rows] = other.length
        self._where = None
