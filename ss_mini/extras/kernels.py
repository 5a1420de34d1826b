"""The device-specific kernel choices of ss_mini, in one place, the same for both decoders.

On a CPU: weights packed once for decoding's few-row products (`Linear`).

Decoding multiplies big weights by few rows: one row in an autoregressive step, a few tens
in a tree pass. Such a product should cost one read of the weight, at the machine's memory
bandwidth. `F.linear` on a CPU does not get there: for every call of more than one row BLAS
re-packs the weight into the layout of its GEMM kernel, so a few-row product reads and
writes the weight more than once (with GPT-2's head a 2-row product can cost twice a 1-row
one); on the CPU of docs/packed-weights.md even one-row products ran faster on a pack.
Packing the weight once into MKL's GEMM layout (`torch.ops.mkl._mkl_reorder_linear_weight`,
what torch.compile's CPU freezing does) removes that work from every call of 1 to 64 rows,
so the autoregressive baseline and the tree passes get the same kernel. Training (gradients
on), small weights, other devices, a torch without MKL and torch.compile keep `F.linear`.
The measurements are in docs/packed-weights.md (`python bench.py --pass_cost
--shape=12,12,768,50257`).

On every device: one LM head call for a pass of few rows (`HEAD_ROWS`, GPT.forward_top).
The 50,257-row head is the biggest weight of a GPT-2 and a decoding step is memory-bound:
a few-row product with it costs about one read of it, so a pass of few main and stream rows
gets the logits of all of them from one read, where a separate call for the accepted
node's draft logits would read the head twice. Above HEAD_ROWS rows, computing logits for
every stream row costs more than that second read; the measurements are in docs/step-cost.md.

On CUDA: attention without cuDNN's backend while decoding (`decoding_kernels`). PyTorch
prefers cuDNN's fused attention for bf16 on recent GPUs, and it builds an execution plan for
every new shape; a decoding pass has a new key length at every step.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

BIG = 1 << 18  # weight entries from which packing pays (smaller weights stay in cache anyway)
FEW = 64  # rows up to which a product counts as few-row
HEAD_ROWS = 32  # main and stream rows up to which a pass runs them through the LM head in one call

MKL_OPS = ("_mkl_linear", "_mkl_reorder_linear_weight")  # Linear calls both


def mkl_packing(ops=torch.ops.mkl):
    """Whether this torch has MKL and both ops that `Linear` calls (a build may lack one of them)."""
    return torch.backends.mkl.is_available() and all(hasattr(ops, op) for op in MKL_OPS)


MKL = mkl_packing()


class Linear(nn.Linear):
    """nn.Linear; in inference on a CPU, products of 1 to 64 rows on big weights use a packed weight."""

    def forward(self, x):
        if MKL and self.in_features * self.out_features >= BIG and x.device.type == "cpu":  # small weights: F.linear
            rows = x.numel() // self.in_features
            if (0 < rows <= FEW and x.dtype == torch.float32 and not torch.is_grad_enabled()
                    and not torch.compiler.is_compiling()):
                y = torch.ops.mkl._mkl_linear(x.reshape(rows, self.in_features), self._packed(), self.weight,
                                              self.bias, rows)
                return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def _packed(self):
        """The weight in MKL's GEMM layout, packed for FEW rows (on some CPUs a pack for fewer rows
        is slower above its size), and again whenever the weight changes (an optimizer step, a
        loaded checkpoint)."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if getattr(self, "_pack_key", None) != key:
            self._pack_key, self._pack = key, torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), FEW)
        return self._pack

    def train(self, mode=True):
        if mode:  # training never uses the pack: free it (GPT-2's is about 0.5 GB in fp32)
            self._pack_key = self._pack = None
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        self._pack_key = self._pack = None  # .to() and friends: the pack would be a copy of the old weight
        return super()._apply(fn, *args, **kwargs)


def decoding_kernels(decode):
    """Decorator of the decoders (generate.py): on CUDA, attention runs on the fused kernels
    that take any shape (flash, memory-efficient) or the math fallback, never cuDNN's."""
    @functools.wraps(decode)
    def run(model, *args, **kwargs):
        if model.lm_head.weight.device.type != "cuda":
            return decode(model, *args, **kwargs)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return decode(model, *args, **kwargs)
    return run
