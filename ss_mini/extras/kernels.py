"""Eager decoding made lean on a CPU: weights packed once for few-row products, and a KV cache
that writes a slice and reads only the slots in use.

Decoding multiplies big weights by few rows: one row in an autoregressive step, a few tens
in a tree pass. Such a product should cost one read of the weight. `F.linear` on a CPU does
not get there: for every call of more than one row BLAS re-packs the weight into the layout
of its GEMM kernel, so a few-row product reads and writes the weight more than once. Packing
it once into MKL's GEMM layout (`torch.ops.mkl._mkl_reorder_linear_weight`, what
torch.compile's CPU freezing does) removes that work from every call of 1 to 64 rows, so the
autoregressive baseline and the tree passes get the same kernel. `pack_linears(model)` turns
a model's big Linear layers into `PackedLinear`, which computes exactly what nn.Linear does
(tested); training (gradients on), small weights, other devices, a torch without MKL and
torch.compile keep `F.linear`. Measured in docs/packed-weights.md.

`LeanKVCache` is kvcache.py's cache for the same eager CPU steps (docs/static-step.md).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kvcache import KVCache

BIG = 1 << 18  # weight entries from which packing pays (smaller weights stay in cache anyway)
FEW = 64  # rows up to which a product counts as few-row

MKL_OPS = ("_mkl_linear", "_mkl_reorder_linear_weight")  # PackedLinear calls both


def mkl_packing(ops=torch.ops.mkl):
    """Whether this torch has MKL and both ops that PackedLinear calls (a build may lack one)."""
    return torch.backends.mkl.is_available() and all(hasattr(ops, op) for op in MKL_OPS)


MKL = mkl_packing()


class PackedLinear(nn.Linear):
    """nn.Linear; in inference on a CPU, products of 1 to 64 rows on big weights use a pack."""

    def forward(self, x):
        big = self.in_features * self.out_features >= BIG  # small weights stay in cache anyway
        if MKL and big and x.device.type == "cpu":
            rows = x.numel() // self.in_features
            if (0 < rows <= FEW and x.dtype == torch.float32 and not torch.is_grad_enabled()
                    and not torch.compiler.is_compiling()):
                y = torch.ops.mkl._mkl_linear(x.reshape(rows, self.in_features), self._packed(),
                                              self.weight, self.bias, rows)
                return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def _packed(self):
        """The weight in MKL's GEMM layout, packed for FEW rows (on some CPUs a pack for fewer rows
        is slower above its size), and again whenever the weight changes (an optimizer step, a
        loaded checkpoint)."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if getattr(self, "_pack_key", None) != key:
            pack = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), FEW)
            self._pack_key, self._pack = key, pack
        return self._pack

    def train(self, mode=True):
        if mode:  # training never uses the pack: free it (GPT-2's is about 0.5 GB in fp32)
            self._pack_key = self._pack = None
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        self._pack_key = self._pack = None  # .to() and friends: the pack holds the old weight
        return super()._apply(fn, *args, **kwargs)


def make_lean(model):
    """The eager CPU path, asked for by the scripts (`--lean=True`): the model's big Linear
    layers packed (`PackedLinear`) and its decoders' cache `LeanKVCache`; the same values (tested).
    On other devices, compiled and in training both fall back to what they replace. In place;
    returns the model."""
    pack_linears(model)
    model.cache_class = LeanKVCache
    return model


def pack_linears(model):
    """The model's nn.Linear layers (LM head and Medusa heads included) become PackedLinear,
    in place; the same weights, the same values. Returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
    return model


class LeanKVCache(KVCache):
    """KVCache for eager steps on a CPU, where reading the rows' lengths costs no synchronisation.
    While every row holds as many tokens L (one prompt: always), a pass writes its keys and values
    as a slice at L, and attention reads only the first slots, up to the pass's end rounded up to
    SPAN, where KVCache gathers per row and reads every slot; an accepted path that is a prefix
    of the pass (the tokens are in place) moves nothing. The same values (tested); compiled
    steps, other devices and rows of different lengths take KVCache's path."""

    SPAN = 16  # slots read are a multiple of it, so a few views serve every pass

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slice = None  # (L, slots read) for this pass, set by `mask` when the rows share L
        self._views = {}  # (layer, slots read): that layer's keys and values, made once

    def mask(self, window):
        self._slice = None
        if self.length.device.type == "cpu" and not torch.compiler.is_compiling():
            lengths = self.length.tolist()
            if min(lengths) == max(lengths):
                L, S = lengths[0], self.max_len
                self._slice = L, min(S, -(-(L + window.shape[2]) // self.SPAN) * self.SPAN)
                return window[..., S - L:S - L + self._slice[1]]
        return super().mask(window)

    def write(self, layer, kv):
        if self._slice is None or kv.requires_grad:
            return super().write(layer, kv)
        L, span = self._slice
        self.kv[layer][:, L:L + kv.shape[1]] = kv
        if (layer, span) not in self._views:
            self._views[layer, span] = self.kv[layer][:, :span].transpose(1, 3).unbind(2)
        return self._views[layer, span]

    def accept(self, path, accepted):
        if self._slice is not None:  # a path that is a prefix of the pass is in place already
            rows = zip(path.tolist(), accepted.tolist())
            if all(p[:a] == list(range(a)) for p, a in rows):
                return self.advance(accepted)
        super().accept(path, accepted)

    def advance(self, accepted):
        super().advance(accepted)
        self._slice = None

    def put_rows(self, rows, other):
        super().put_rows(rows, other)
        self._slice = None
