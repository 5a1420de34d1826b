"""Around the method: Medusa heads (the paper's baseline), parallel tree pruning, distilled
stream targets, compiled steps and a CPU's lean eager decoding (`kernels.make_lean`: packed
weights, a KV cache that writes slices). `build_model` makes what a config describes."""
from ..model import GPT
from .medusa import MedusaGPT
from .pruning import PruningGPT


def build_model(config):
    """The model a config describes: GPT, or GPT with Medusa heads or the pruning adapter. It
    decodes through the method's own classes (nn.Linear, KVCache) until `make_lean` is asked for."""
    cls = MedusaGPT if config.n_medusa_heads else PruningGPT if config.prune_adapter_rank else GPT
    return cls(config)
