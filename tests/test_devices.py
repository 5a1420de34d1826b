"""Readiness for the devices the scripts pick on their own (CUDA, then MPS), checked on a CPU:
every aten operation that training and the decoders dispatch has an Apple MPS kernel, and a
decoder reuses its KV cache's memory from one call to the next (one CUDA graph per shape)."""
import os

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

import torchgen
from ss_mini.extras import make_tree
from ss_mini.extras.distill import stream_teacher
from ss_mini.baseline import generate_ar
from ss_mini.generate import generate_speculative
from ss_mini.model import GPT, GPTConfig

# Every aten operation (name.overload) that training (forward and backward) and both decoders
# (Cartesian, budget and lookup trees; greedy and sampled; one row and a batch that a prompt
# joins) dispatch on a CPU, found by `_record`. A new op fails test_every_op_has_an_mps_kernel
# until it is added here, after checking that MPS has it (or replacing it: MPS has no `take`).
OPS = """
__and__.Tensor __ior__.Tensor _local_scalar_dense.default _log_softmax.default
_log_softmax_backward_data.default _scaled_dot_product_flash_attention_for_cpu.default
_scaled_dot_product_flash_attention_for_cpu_backward.default _softmax.default
_unsafe_view.default add.Tensor add_.Tensor addcdiv_.default addcmul_.default addmm.default
alias.default any.dim arange.default arange.start_step argmax.default bitwise_and.Tensor
bitwise_not.default bitwise_or_.Tensor cat.default clamp.default clamp_min.default
clamp_min_.default clone.default contiguous.default copy_.default cumsum.default detach.default
detach_.default div.Tensor embedding.default embedding_dense_backward.default
empty.memory_format expand.default eye.default fill_.Scalar fill_.Tensor flatten.using_ints
gather.default ge.Scalar gelu.default gelu_backward.default gt.Scalar gt.Tensor index.Tensor
index_copy_.default index_put_.default index_select.default layer_norm.default lerp_.Scalar
lift_fresh.default linear.default log.default lt.Tensor masked_fill.Scalar masked_fill_.Scalar
matmul.default minimum.default mm.default mul.Tensor mul_.Tensor native_layer_norm.default
native_layer_norm_backward.default ne.Scalar ne.Tensor neg.default new_full.default
new_zeros.default nll_loss_backward.default nll_loss_forward.default normal_.default
numpy_T.default ones.default ones_like.default rand.generator randint.default randint.low
repeat_interleave.self_int reshape.default resolve_conj.default resolve_neg.default roll.default
rsub.Scalar scalar_tensor.default scaled_dot_product_attention.default scatter.src scatter.value
scatter_.src scatter_add.default scatter_add_.default select.int select_backward.default
slice.Tensor slice_backward.default softmax.int sort.default sort.stable sqrt.default
squeeze.dim stack.default sub.Tensor sum.default sum.dim_IntList t.default to.dtype
to.dtype_layout topk.default transpose.int tril.default unbind.int unflatten.int
uniform_.default unsqueeze.default view.default where.self zero_.default zeros.default
zeros_like.default
""".split()

# On MPS, scaled_dot_product_attention (a composite) dispatches MPS's own attention backend in
# place of the CPU's, which is the one recorded here.
CPU_BACKEND = {"_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward"}
# Kernels that serve every device: they run other ops, which have their own kernels.
COMPOSITE = {"CompositeImplicitAutograd", "CompositeExplicitAutograd",
             "CompositeExplicitAutogradNonFunctional"}


class _Record(TorchDispatchMode):
    """Every aten op dispatched inside it, as 'name.overload', and those that made float64."""

    def __init__(self):
        super().__init__()
        self.ops, self.float64 = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "aten":  # the profiler's marks (an optimizer step) run anywhere
            return out
        name = f"{func._schema.name.split('::')[-1]}.{func._overloadname}"
        self.ops.add(name)
        outs = out if isinstance(out, (tuple, list)) else [out]
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in outs):
            self.float64.add(name)
        return out


def _model(**kw):
    """A plain GPT with streams, as a device other than a CPU decodes it (KVCache, F.linear)."""
    torch.manual_seed(0)
    args = dict(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=11, n_streams=3,
                n_msa_layers=1, stream_stride=2, stream_targets="main")
    args.update(kw)
    model = GPT(GPTConfig(**args))
    with torch.no_grad():  # peaked distributions: drafts are accepted, paths run deep
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.4)
    return model


def _record():
    """Run what the paths run, in float32, and record their ops."""
    rec = _Record()
    with rec:
        model = _model().train()  # training: forward, Eq. 5 with distilled targets, backward
        idx = torch.randint(0, 11, (2, 16))
        _, _, losses = model(idx, idx.roll(-1, 1), teacher=stream_teacher)
        losses["loss"].backward()
        torch.optim.AdamW(model.parameters()).step()
        model.eval()
        one, batch = [1, 2, 3, 1, 2], [[1, 2, 3, 1, 2], [4, 5], [6, 7, 6]]
        for kw in ({}, dict(temperature=0.8, top_k=5, top_p=0.9, seed=1)):
            for prompts, bs in ((one, None), (batch, 2)):
                generate_ar(model, prompts, 12, batch_size=bs, **kw)
                for spec in ("3,2,1", "n8", "1,1+L4", "L4"):
                    tree = make_tree(spec, model.config.n_streams)
                    generate_speculative(model, prompts, 12, tree, batch_size=bs, **kw)
    return rec


def _mps_kernels():
    """{'name.overload': True if MPS has a kernel for it or a composite serves it} from the
    native_functions.yaml that this torch ships (torchgen's packaged copy)."""
    path = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "ATen", "native",
                        "native_functions.yaml")
    with open(path) as f:
        entries = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    by_name = {}
    for e in entries:
        name = e["func"].split("(", 1)[0]
        by_name[name if "." in name else name + ".default"] = e

    def has(name):
        e = by_name[name]
        if "structured_delegate" in e:  # a functional op computed by its out= variant
            return has(e["structured_delegate"])
        if "dispatch" not in e:  # no kernel of its own: CompositeImplicitAutograd
            return True
        keys = {k.strip() for ks in e["dispatch"] for k in ks.split(",")}
        return bool(keys & ({"MPS"} | COMPOSITE))
    return {name: has(name) for name in by_name}


@pytest.fixture(scope="module")
def recorded():
    return _record()


def test_every_op_the_paths_call_is_listed(recorded):
    new = sorted(recorded.ops - set(OPS))
    assert not new, (f"training or decoding now calls {new}: check each has an MPS kernel "
                     "(test_every_op_has_an_mps_kernel) and add it to OPS")


def test_every_op_has_an_mps_kernel():
    kernels = _mps_kernels()
    missing = [op for op in OPS if op.split(".")[0] not in CPU_BACKEND and not kernels[op]]
    assert not missing, f"no MPS kernel for {missing}: replace them (a gather, an index_select)"


def test_take_has_no_mps_kernel_and_is_not_called(recorded):
    """What the list guards against: torch's `take` is dispatched for CPU and CUDA only."""
    assert not _mps_kernels()["take.default"]
    assert "take.default" not in recorded.ops


def test_nothing_on_the_paths_makes_float64(recorded):
    assert not recorded.float64, f"MPS has no float64: {sorted(recorded.float64)}"


def test_a_decoder_reuses_its_cache_memory_across_calls():
    """Two decodes of one model, batch size and cache size write the same tensors (so a CUDA
    graph recorded by the first replays in the second), even while the first decode's cache is
    still held; each output is still its prompt's own."""
    from ss_mini import baseline, step
    model = _model().eval()
    caches = []
    steps = {"ss": step.speculative_step, "ar": baseline.ar_step}

    def keep(name):
        def run(model, cache, *args, **kwargs):
            caches.append(cache)  # holds each decode's cache object
            return steps[name](model, cache, *args, **kwargs)
        return run

    tree = make_tree("3,2,1", 3)
    for decode, name, kw in ((generate_speculative, "ss", dict(tree=tree)),
                             (generate_ar, "ar", {})):
        caches.clear()
        outs = [decode(model, p, 16, step=keep(name), **kw)[0] for p in ([1, 2, 3], [4, 5])]
        first, second = caches[0], caches[-1]
        assert first is not second
        assert [t.data_ptr() for t in [*first.kv, first.length]] == \
            [t.data_ptr() for t in [*second.kv, second.length]]
        for p, out in zip(([1, 2, 3], [4, 5]), outs):
            assert out == generate_ar(model, p, 16)[0]
