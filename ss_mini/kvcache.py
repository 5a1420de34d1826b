"""The KV cache of decoding: one preallocated tensor for all layers, a length pointer, and
the compaction of an accepted tree path (paper §3.2: accept)."""
import torch


class KVCache:
    """Preallocated keys/values of all layers, with a length pointer L (the accepted tokens).

    A pass over n nodes (and their stream rows) writes tentative K/V at slots L, L+1, ...
    (`length` stays L); `accept` then keeps the accepted nodes at L..L+a-1. Stream rows are
    written after the nodes only so that their attention reads one contiguous view; they
    are never accepted, so streams keep no cache of their own (Eq. 2: they read the main
    stream's). One tensor for all layers: compacting an accepted path is one gather.
    """

    def __init__(self, config, max_len, batch_size=1, device="cpu", dtype=torch.float32):
        hd = config.n_embd // config.n_head
        self.kv = torch.zeros(config.n_layer, 2, batch_size, config.n_head, max_len, hd, device=device, dtype=dtype)
        self.length = 0

    def write(self, layer, kv):
        """Store a pass's keys and values kv (2, B, H, rows, hd) after the prefix; return all
        keys and values so far."""
        L, n = self.length, kv.shape[3]
        if L + n > self.kv.shape[4]:
            raise ValueError(f"KV cache overflow: {L} + {n} > {self.kv.shape[4]} slots")
        self.kv[layer, :, :, :, L:L + n] = kv
        return self.kv[layer, :, :, :, :L + n].unbind(0)

    def accept(self, path):
        """Keep the tentative slots of the nodes `path` (sorted node indices) as L..L+a-1, or
        the first `path` if it is an int. A path that is a prefix of the nodes (a chain, or
        the root alone) is already in place."""
        a, L = (path, self.length) if isinstance(path, int) else (len(path), self.length)
        if not isinstance(path, int) and path[-1] != a - 1:
            index = torch.tensor(path, device=self.kv.device) + L
            self.kv[..., L:L + a, :] = self.kv[..., index, :]  # index_select copies first: no aliasing
        self.length += a

    def reset(self):
        self.length = 0
