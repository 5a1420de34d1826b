"""The KV cache of decoding: one preallocated tensor per layer for a batch of rows, a length
per row, and the compaction of each row's accepted tree path (paper §3.2: accept)."""
import torch


class KVCache:
    """Keys and values of all layers for B rows, with a length L[b] per row (a tensor on the
    device: a step never asks the host where to write), as gpt-fast keeps its cache.

    Row b holds its accepted tokens at slots 0..L[b]-1, with no padding before them (learned
    absolute positions would make left padding wrong). A pass over R rows (nodes and their stream
    rows) writes its keys and values at slots L[b].. of each row, and attention reads all max_len
    slots through a mask that hides what a row must not see (`mask`): the shapes never change from
    step to step. `accept` then keeps each row's own path at L[b]..L[b]+a[b]-1; slots past a row's
    length hold stale values that the mask hides and the next pass overwrites. Stream rows are
    never accepted: streams keep no cache of their own (Eq. 2: they read the main stream's).
    """

    def __init__(self, config, max_len, batch_size=1, device="cpu", dtype=torch.float32,
                 memory=None):
        """memory: a dict (a model's `kv_memory`) whose tensors of this size the cache takes over,
        so every decode of one size writes the same addresses (one CUDA graph replays)."""
        key = (max_len, batch_size, str(device), dtype, torch.is_inference_mode_enabled())
        if memory is not None and key in memory:  # stale slots past the lengths stay hidden
            self.kv, self.length = memory[key]
            self.length.zero_()
        else:  # per layer (row, slot, key or value, head, head dim): a slot's key and value are
            # one run of memory, so writing or moving a slot is one vector copy (index_copy_)
            hd = config.n_embd // config.n_head
            self.kv = [torch.zeros(batch_size, max_len, 2, config.n_head, hd, device=device,
                                   dtype=dtype) for _ in range(config.n_layer)]
            self.length = torch.zeros(batch_size, dtype=torch.long, device=device)
            memory = {} if memory is None else memory
            memory[key] = self.kv, self.length
        self.slot, self.max_len = torch.arange(max_len, device=device), max_len
        self.row_start = torch.arange(batch_size, device=device)[:, None] * max_len
        self._dest = None  # (R, the flat slots where this pass's R rows go): made once a pass

    def write(self, layer, kv):
        """Store a pass's keys and values kv (B, R, 2, H, hd) at slots L[b].. of each row;
        return the keys and the values of all slots, (B, H, max_len, hd) each."""
        if kv.requires_grad:
            raise RuntimeError("a KV cache keeps no autograd history: decode under "
                               "torch.no_grad() or torch.inference_mode()")
        R = kv.shape[1]
        if self._dest is None or self._dest[0] != R:  # the first layer, and again above the streams
            self._dest = R, self.flat(self.length[:, None] + self.slot[:R])
        self.kv[layer].flatten(0, 1).index_copy_(0, self._dest[1], kv.flatten(0, 1))
        return self.kv[layer].transpose(1, 3).unbind(2)

    def flat(self, slots):
        """Indices of slots (B, R) of each row in a layer seen as one run of B * max_len slots."""
        return (self.row_start + slots).flatten()

    def mask(self, window):
        """Each row's mask over the cache's slots (B, 1, R, max_len) from a pass's
        `attention_window`: row b's prefix is slots < L[b], its pass sits at L[b].."""
        R, S = window.shape[2], self.max_len
        index = (S - self.length).view(-1, 1, 1, 1) + self.slot  # row b's window starts at S - L[b]
        return window.expand(len(self.length), -1, -1, -1).gather(3, index.expand(-1, -1, R, -1))

    def accept(self, path, accepted):
        """Keep each row's accepted nodes: node path[b, i] of this pass moves to slot L[b] + i,
        and L[b] += accepted[b]. path (B, P) holds node indices, root first, padded past a row's
        accepted length with any node (those slots lie past the new length)."""
        src = self.flat(self.length[:, None] + path)
        dst = self.flat(self.length[:, None] + self.slot[:path.shape[1]])
        for kv in self.kv:
            slots = kv.flatten(0, 1)
            slots.index_copy_(0, dst, slots.index_select(0, src))
        self.advance(accepted)

    def advance(self, accepted):
        """L += accepted: the first accepted[b] rows of the pass are already in place."""
        self.length += accepted
        self._dest = None

    def put_rows(self, rows, other):
        """Rows of this cache replaced by another cache's, of as many slots or fewer (a rebuilt
        window, a prompt joining): slots past the other's keep stale values, past the lengths."""
        for kv, new in zip(self.kv, other.kv):
            kv[rows, :new.shape[1]] = new
        self.length[rows] = other.length
        self._dest = None
