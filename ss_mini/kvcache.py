"""The KV cache of decoding: one preallocated tensor per layer for a batch of rows, a length
per row, and the compaction of each row's accepted tree path (paper §3.2: accept)."""
import torch


class KVCache:
    """Preallocated keys/values of all layers for B rows, with a length L[b] per row (a tensor,
    on the device: the step never asks the host where to write).

    Row b holds its accepted tokens at slots 0..L[b]-1, with no padding before them (learned
    absolute positions would make left padding wrong). A pass over R rows (nodes and their
    stream rows) writes its K/V at slots L[b], L[b]+1, ... of each row, and attention reads all
    max_len slots with a mask that hides what a row must not see (`mask`, masks.py): the
    shapes of a compiled step never change from step to step (eager passes read only the
    slots in use, `read_to`). `accept` then keeps each row's own path at
    L[b]..L[b]+a[b]-1; slots past a row's length hold stale values that the next pass
    overwrites and the mask hides. Stream rows are never accepted: streams keep no cache of
    their own (Eq. 2: they read the main stream's). One tensor per layer, as in gpt-fast: a
    compiled step then writes each in place, where a tensor that several layers write is
    copied whole by the compiler's functional form of the writes, at every step.
    """

    def __init__(self, config, max_len, batch_size=1, device="cpu", dtype=torch.float32):
        hd = config.n_embd // config.n_head
        # per layer (row, slot, key or value, head, head dim): a slot's keys and values are one run
        # of memory, so writing or moving a slot copies one vector (index_copy_ over flat slots)
        self.kv = [torch.zeros(batch_size, max_len, 2, config.n_head, hd, device=device, dtype=dtype)
                   for _ in range(config.n_layer)]
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slot, self.max_len = torch.arange(max_len, device=device), max_len
        self._views()

    def _views(self):
        """Per set of rows: where each row's slots start in a layer seen as one flat run of slots,
        and each layer's views (its flat slots to write, its keys and values to read), made once:
        a decoding step would otherwise spend a few tensor operations per layer remaking them."""
        B, S = self.kv[0].shape[:2]
        self.first_slot = (torch.arange(B, device=self.slot.device) * S)[:, None] + self.slot  # (B, S)
        self.layer_slots = [kv.flatten(0, 1) for kv in self.kv]  # (B * S, 2, H, hd)
        self._spans = {}  # each span read so far: its layers' keys and values, its slots (`read_to`)
        self.read_to([S], 0)
        self._where = self._same_length = None  # (R, the flat slots of this pass's R rows); the rows' one length

    def read_to(self, lengths, pass_rows):
        """Eager decoding: the next pass, of pass_rows rows, attends over the first slots only
        (rounded up to a multiple of 16), where every row's prefix and pass lie; `lengths` is the
        decoder's copy of L (a list: it knows them from the tokens it emits). Fewer keys, the same
        attention: the mask hides the rest anyway. When every row has the same length (one row,
        always), where the pass writes and what it sees are slices, not a gather per row. A
        compiled step attends over all slots, so that its shapes never change."""
        S, longest = self.max_len, max(lengths)
        self.span = min(S, -(-(longest + pass_rows) // 16) * 16)
        if self.span not in self._spans:  # each layer's keys and values (B, H, span, hd), and the slots
            layers = [kv[:, :self.span].transpose(1, 3).unbind(2) for kv in self.kv]
            self._spans[self.span] = layers, self.slot[:self.span]
        self._read, self._read_slots = self._spans[self.span]
        self._same_length = longest if min(lengths) == longest else None

    def _index(self, slots):
        """Flat indices of slots (B, R) of each row: (B * R,)."""
        return self.first_slot.gather(1, slots).flatten()

    def write(self, layer, kv):
        """Store a pass's keys and values kv (B, R, 2, H, hd) at slots L[b].. of each row; return
        the keys and values of the slots read (B, H, slots, hd) each: all max_len when compiled,
        the first `span` eager."""
        if kv.requires_grad:
            raise RuntimeError("a KV cache keeps no autograd history: decode under torch.no_grad() or "
                               "torch.inference_mode()")
        R = kv.shape[1]
        if not torch.compiler.is_compiling() and self._same_length is not None:  # rows of one length: a slice
            L = self._same_length  # (read only outside a graph, which would otherwise guard on it)
            self.kv[layer][:, L:L + R] = kv
            return self._read[layer]
        if self._where is None or self._where[0] != R:  # made by the first layer (and again above stream insertion)
            self._where = R, self._index(self.length[:, None] + self.slot[:R])
        self._slots(layer).index_copy_(0, self._where[1], kv.flatten(0, 1))
        return self.kv[layer].transpose(1, 3).unbind(2) if torch.compiler.is_compiling() else self._read[layer]

    def _slots(self, layer):
        """A layer's slots as one flat run (B * S, 2, H, hd): a graph makes the view itself, for
        free (it cannot take inputs that alias), eager decoding reuses the one made by `_views`."""
        return self.kv[layer].flatten(0, 1) if torch.compiler.is_compiling() else self.layer_slots[layer]

    def mask(self, window):
        """Each row's mask over the slots read (as `write`), (B, 1, R, slots), from a pass's
        `attention_window`: slots < L[b] are the prefix, the pass sits at L[b].. (masks.py)."""
        R, S = window.shape[2], self.max_len
        if not torch.compiler.is_compiling() and self._same_length is not None:  # (a graph never reads it)
            return window[..., S - self._same_length:S - self._same_length + self.span]
        slots = self.slot if torch.compiler.is_compiling() else self._read_slots
        index = (S - self.length).view(-1, 1, 1, 1) + slots  # row b's window starts at S - L[b]
        return window.expand(len(self.length), -1, -1, -1).gather(3, index.expand(-1, -1, R, -1))

    def accept(self, path, accepted):
        """Keep each row's accepted nodes: the node path[b, i] of this pass moves to slot
        L[b] + i, and L[b] += accepted[b]. path (B, P) holds node indices, root first, padded
        past a row's accepted length with any node (those slots lie past the new length)."""
        src = self._index(self.length[:, None] + path)
        dst = self._index(self.length[:, None] + self.slot[:path.shape[1]])
        for layer in range(len(self.kv)):
            slots = self._slots(layer)
            slots.index_copy_(0, dst, slots.index_select(0, src))
        self.advance(accepted)

    def advance(self, accepted):
        """L += accepted: the first accepted[b] rows of the pass are already in place (a chain)."""
        self.length += accepted
        self._where = self._same_length = None

    def rewind(self, length):
        """Every row back to `length` tokens (a benchmark repeats one step)."""
        self.length.fill_(length)
        self._where = self._same_length = None

    def keep_rows(self, rows):
        """Only these rows go on (the others finished): (B',) row indices."""
        self.kv, self.length = [kv[rows] for kv in self.kv], self.length[rows]
        self._views()

    def put_rows(self, rows, other):
        """Rows of this cache replaced by the rows of another, of as many slots or fewer (a rebuilt
        window, a prompt joining): the slots past the other's keep stale values, past the rows' lengths."""
        for kv, new in zip(self.kv, other.kv):
            kv[rows, :new.shape[1]] = new  # in place: the layers' views stay valid
        self.length[rows] = other.length
        self._where = self._same_length = None
