"""Around the method: Medusa heads (the paper's baseline), parallel tree pruning, distilled
stream targets, compiled steps and a CPU's lean eager decoding (packed weights, a KV cache that
writes slices). `build_model` makes what a config describes."""
from ..model import GPT
from .kernels import LeanKVCache, pack_linears
from .medusa import MedusaGPT
from .pruning import PruningGPT


def build_model(config):
    """The model a config describes: GPT, or with Medusa heads or the pruning adapter, made lean
    for a CPU's eager decoding (kernels.py: the same values): its big Linear layers packed for
    few-row products, its cache `LeanKVCache`."""
    cls = MedusaGPT if config.n_medusa_heads else PruningGPT if config.prune_adapter_rank else GPT
    model = pack_linears(cls(config))
    model.cache_class = LeanKVCache
    return model
