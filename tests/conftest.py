import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# train.py, sample.py and bench.py are scripts at the top level
sys.path.insert(0, ROOT)

from ss_mini import build_model  # noqa: E402

# the tests' models are tiny: one thread runs them faster than two that wait on each other (and
# the scripts the tests start inherit it)
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
from ss_mini.extras.kernels import make_lean  # noqa: E402
from ss_mini.model import GPTConfig  # noqa: E402


def random_model(seed=0, dtype=torch.float64, std=None, lean=False, **kw):
    """A random untrained model; std > 0.02 makes its distributions peaked (drafts then match
    often); lean: with the eager CPU kernels of the scripts (extras/kernels.py `make_lean`)."""
    torch.manual_seed(seed)
    args = dict(n_layer=3, n_head=2, n_embd=16, block_size=32, vocab_size=11, n_streams=3,
                n_msa_layers=2)
    args.update(kw)
    model = build_model(GPTConfig(**args))
    if std:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 or name == "stream_emb":
                    p.normal_(0.0, std)
    model = model.to(dtype).eval()
    return make_lean(model) if lean else model


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny model trained for a few iterations on the Python standard library (char level)."""
    import train
    out = tmp_path_factory.mktemp("tiny")
    train.main([f"--out_dir={out}", f"--data_dir={out / 'data'}", "--n_layer=2", "--n_head=2",
                "--n_embd=32", "--block_size=48", "--batch_size=8", "--max_iters=120",
                "--eval_interval=60", "--eval_iters=2", "--log_interval=1000", "--warmup_iters=10",
                "--learning_rate=3e-3"])
    return out


def fake_tree_search(monkeypatch, timings, n_drafts=4, prompts=("p0", "p1"), slow=None, drain=None,
                     **cfg):
    """The tree search (ss_mini/lab/tree_choice.py) with bench's defaults, on fake decoders over the
    prompts: timings maps a tree to (tokens per pass, ms per pass); an autoregressive
    pass takes 1 ms; slow maps (tree, prompt) to a factor on that decode's time (a slow spell
    of the machine); drain maps a tree to a factor on its whole decode's time over the time
    while all rows decode (a batch's last rows finishing one by one). Returns the chosen tree,
    the search's rows and every call as (decoder, prompt, max_new_tokens)."""
    import bench
    from types import SimpleNamespace
    from ss_mini.lab import tree_choice
    from ss_mini.serving import Stats
    calls = []

    def fake_ar(model, prompt, max_new_tokens, **kw):
        calls.append(("ar", prompt, max_new_tokens))
        return [0] * 24, Stats(new_tokens=24, passes=24, accepted=[1] * 24, seconds=24e-3,
                               full_tokens=24, full_passes=24, full_seconds=24e-3)

    def fake_ss(model, prompt, tree, max_new_tokens, **kw):
        calls.append((repr(tree), prompt, max_new_tokens))
        tau, ms = timings[repr(tree)]
        passes = 24 // tau
        seconds = passes * ms * 1e-3 * (slow or {}).get((repr(tree), prompt), 1)
        return [0] * 24, Stats(new_tokens=24, passes=passes, accepted=[tau] * passes,
                               nodes=[len(tree)] * passes,
                               seconds=seconds * (drain or {}).get(repr(tree), 1), full_tokens=24,
                               full_passes=passes, full_seconds=seconds)

    from ss_mini.lab import lockstep, measure
    for module in (lockstep, measure):  # the search's decoders, and the measured ones
        monkeypatch.setattr(module, "generate_ar", fake_ar)
        monkeypatch.setattr(module, "generate_speculative", fake_ss)
    model = SimpleNamespace(config=SimpleNamespace(n_drafts=n_drafts), kv_memory={})
    cfg = dict(bench.config, candidates=";".join(timings), **cfg)
    best, rows = tree_choice.tree_search(model, list(prompts), cfg, dict(max_new_tokens=256),
                                         lambda *a: None)
    return best, rows, calls
