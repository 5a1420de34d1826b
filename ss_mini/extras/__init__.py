"""Around the method: Medusa heads (the paper's baseline), parallel tree pruning, the lossless
mode's stream adapters, distilled stream targets, budget and lookup trees, compiled steps and a
CPU's lean eager decoding (`kernels.make_lean`: packed weights, a KV cache that writes slices).
`build_model` makes the model a config describes, `make_tree` the tree a spec describes
('3,2,1', 'n16', '1,1+L8', ...), extensions included."""
from ..model import GPT
from ..tree import CartesianTree
from .budget_tree import BudgetTree
from .lookup import LookupTree
from .lossless import LosslessGPT, LosslessPruningGPT
from .medusa import MedusaGPT
from .pruning import PruningGPT


def build_model(config):
    """The model a config describes: GPT, or GPT with Medusa heads, the pruning adapter or the
    lossless mode's stream adapters. It decodes through the method's own classes (nn.Linear,
    KVCache) until `make_lean` (kernels.py) is asked for."""
    cls = MedusaGPT if config.n_medusa_heads else PruningGPT if config.prune_adapter_rank else GPT
    if config.stream_adapter_rank and config.n_streams:
        cls = LosslessPruningGPT if cls is PruningGPT else LosslessGPT
    return cls(config)


def make_tree(spec, n_drafts):
    """'3,2,1' (Cartesian top-k per depth; '1' repeated = a chain), 'n16' (node budget),
    'chain' (the top-1 chain over all the model's streams: 1,1,1,1 for gamma = 4), 'none'
    (no tree: plain decoding; None); '+L4' after a Cartesian tree adds a chain of 4 tokens
    drafted from the decoded text, and 'L4' alone is prompt-lookup decoding (extras/lookup.py)."""
    spec = str(spec).strip()
    usage = (f"--tree={spec}: give top-k per depth (e.g. 3,2,1 or 1,1,1), a node budget (e.g. "
             "n16), chain or none, and + L and a length to add a lookup branch (1,1,1+L4, L4)")
    streams, plus, chain = spec.rpartition("L") if "L" in spec else (spec, "", "")
    if plus:
        if (streams and not streams.endswith("+")) or not chain.isdigit():
            raise ValueError(usage)
        try:
            tree = make_tree(streams[:-1], n_drafts) if streams else None
        except ValueError as e:  # said of the whole spec
            raise ValueError(f"--tree={spec}: {str(e).split(': ', 1)[-1]}") from None
        if streams and type(tree) is not CartesianTree:
            raise ValueError(f"--tree={spec}: a lookup branch goes with a top-k tree (e.g. "
                             "1,1,1+L4, chain+L8) or alone (L4)")
        return LookupTree(tree.ks if tree else (), int(chain))
    if spec == "none":
        return None
    if spec == "chain":
        return CartesianTree([1] * n_drafts)
    try:
        if spec.startswith("n"):
            return BudgetTree(int(spec[1:]))
        ks = [int(k) for k in spec.split(",")]
    except ValueError:
        raise ValueError(usage) from None
    if len(ks) > n_drafts:
        raise ValueError(f"--tree={spec} has {len(ks)} depths, the model {n_drafts} streams")
    if min(ks) < 1:
        raise ValueError(f"--tree={spec}: give a top-k of at least 1 for each depth, e.g. 3,2,1")
    return CartesianTree(ks)
