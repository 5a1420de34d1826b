"""Decoding steps compiled whole: `compile_step(step)` (step.py's speculative_step, or the
baseline's ar_step).

The step's shapes never change from step to step, so one graph (torch.compile, fullgraph=True,
dynamic=False) serves every step of a tree and batch size; the prefill stays eager. On CUDA
the graph is replayed as a CUDA graph (mode="reduce-overhead"): inductor records one only
when every tensor the step writes in place has a static address, so the cache's tensors are
marked static (`mark_static`), and the outputs are copied out of the graph's memory before
the next replay overwrites them. On a CPU it runs inductor's C++ wrapper with the weights
frozen into the graph: a model whose weights change in place afterwards is refused in one
line. MPS decodes eagerly (and says so once). The first steps pay the compilation (seconds per
tree and batch size on a CPU).
"""
import warnings
import weakref

import torch
from torch._inductor import config as inductor_config
from torch.utils._pytree import tree_map

from ..sampling import Sampler

MAX_GRAPHS = 64  # graphs one step function may keep in a process (trees x batch sizes x models)
_SEEN = {}  # per step function, what its graphs are specialised on: dynamo counts per function
# per model, its weights and their versions when a CPU graph first froze them: dynamo keeps its
# graphs per step function, so every compiled step of the process shares this
_FROZEN = weakref.WeakKeyDictionary()


def mark_static(cache):
    """Mark the tensors a step writes in place (each layer's keys and values, the lengths) as
    static addresses, once per cache: a CUDA graph replays its writes at those addresses."""
    if not getattr(cache, "static", False):
        for t in [*cache.kv, cache.length]:
            torch._dynamo.mark_static_address(t, guard=False)
        cache.static = True


def _guards_to_keep(guards):
    """Which of dynamo's checks a compiled CPU step keeps before each call: not those on the
    model's modules (many, and their cost shows in a small step), but each weight's identity,
    so that a graph with frozen weights never serves another model."""
    return [not g.orig_guard.source.is_unspecialized_nn_module() or g.guard_type == "ID_MATCH"
            for g in guards]


def _kind(arg):
    """What of a step's argument a graph is specialised on: a tensor's shape, a sampler's mode
    (greedy or not), a tree's spec."""
    if isinstance(arg, torch.Tensor):
        return tuple(arg.shape)
    return arg.gen is None if isinstance(arg, Sampler) else repr(arg)


def _raise_recompile_limit():
    """Let dynamo keep MAX_GRAPHS graphs of a step (its own limit is lower)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(MAX_GRAPHS, getattr(config, name)))


def compile_step(step):
    """`step` compiled for the device of the model it is called with (the first argument)."""
    graphs, seen = {}, _SEEN.setdefault(step, set())
    warned = []

    def run(model, cache, *args, **kwargs):
        device = model.lm_head.weight.device.type
        if device == "mps":
            if not warned:
                warned.append(device)
                warnings.warn("compiled steps: torch.compile does not capture them on MPS; "
                              "decoding eagerly", stacklevel=2)
            return step(model, cache, *args, **kwargs)
        if device == "cpu":
            _check_frozen(model)
        key = (id(model), cache.kv[0].shape[0], *map(_kind, args))
        if key not in seen:
            if len(seen) >= MAX_GRAPHS:
                raise RuntimeError(f"{step.__name__} is compiled for {len(seen)} models, trees, "
                                   "batch sizes and sampling modes in this process, its limit: "
                                   "decode the rest with the eager step")
            seen.add(key)
            _raise_recompile_limit()
        if device not in graphs:
            graphs[device] = _compile(step, device)
        if device == "cuda":
            mark_static(cache)
        return graphs[device](model, cache, *args, **kwargs)
    run.__name__, run.__wrapped__ = f"compiled_{step.__name__}", step
    return run


def _check_frozen(model):
    """Refuse a model whose weights changed in place (an optimizer step, load_state_dict) since a
    CPU graph froze them: the graph would decode with the old ones."""
    if model not in _FROZEN:
        params = list(model.parameters())
        _FROZEN[model] = params, [p._version for p in params]
    params, versions = _FROZEN[model]
    if [p._version for p in params] != versions:
        raise RuntimeError("the model's weights changed since a compiled CPU step froze them: "
                           "decode it with the eager step, or compile in a new process")


def _compile(step, device):
    if device == "cuda":
        graph = torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")

        def replay(*args, **kwargs):  # copies: the next replay writes into the same buffers
            torch.compiler.cudagraph_mark_step_begin()
            out = graph(*args, **kwargs)
            return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
        return replay
    # one compile thread: a pool of compile workers left beside the decoder slows it
    options = {"cpp_wrapper": True, "compile_threads": 1}
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # torch filters guards
        options["guard_filter_fn"] = _guards_to_keep
    graph = torch.compile(step, fullgraph=True, dynamic=False, options=options)

    def frozen(*args, **kwargs):
        # dynamo reads the freezing switch while it traces, before a compile's options apply;
        # set by hand, as config.patch costs tens of microseconds a call
        was, inductor_config.freezing = inductor_config.freezing, True
        try:
            return graph(*args, **kwargs)
        finally:
            inductor_config.freezing = was
    return frozen
