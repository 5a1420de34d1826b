"""ss_mini: Speculative Streaming (Bhendawade et al., 2024, arXiv 2402.11131), minimal.

The method: model.py (the GPT with streams), masks.py (Eq. 2), tree.py (tree drafts),
kvcache.py, sampling.py, step.py (one step in four phases) and generate.py (the decoders).
Around it: extras/ (Medusa, pruning, distillation, compiled steps, CPU kernels), io/ (data,
checkpoints, flags, nanoGPT and GPT-2 weights) and lab/ (what bench.py measures with).
"""
from .extras import build_model
from .extras.compile import compile_step
from .generate import Stats, generate_ar, generate_speculative
from .io.checkpoint import load_model
from .model import GPT, GPTConfig
from .step import ar_step, speculative_step
from .extras.budget_tree import make_tree
