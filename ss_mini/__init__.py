"""ss_mini: Speculative Streaming (Bhendawade et al., 2024, arXiv 2402.11131), minimal.

The method: model.py (the GPT with streams), masks.py (Eq. 2), tree.py (tree drafts),
kvcache.py, sampling.py, step.py (one step in four phases), generate.py (the decoder) and
serving.py (the rows of a batch). baseline.py: plain decoding, the baseline. Around it: extras/
(Medusa, pruning, lossless mode, lookup and budget trees, compiled steps, CPU kernels), io/
(data, checkpoints, flags, nanoGPT and GPT-2 weights) and lab/ (what bench.py measures with).
"""
from .extras import build_model, make_tree
from .extras.compile import compile_step
from .baseline import ar_step, generate_ar
from .generate import generate_speculative
from .io.checkpoint import load_model
from .model import GPT, GPTConfig
from .serving import Stats
from .step import speculative_step
