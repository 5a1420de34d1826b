import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py, sample.py and bench.py are scripts at the top level

from ss_mini.model import GPT, GPTConfig  # noqa: E402


def random_model(seed=0, dtype=torch.float64, std=None, **kw):
    """A random untrained model; std > 0.02 makes its distributions peaked (drafts then match often)."""
    torch.manual_seed(seed)
    args = dict(n_layer=3, n_head=2, n_embd=16, block_size=32, vocab_size=11, n_streams=3, n_msa_layers=2)
    args.update(kw)
    model = GPT(GPTConfig(**args))
    if std:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 or name == "stream_emb":
                    p.normal_(0.0, std)
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny model trained for a few iterations on the Python standard library (char level)."""
    import train
    out = tmp_path_factory.mktemp("tiny")
    train.main([f"--out_dir={out}", f"--data_dir={out / 'data'}", "--n_layer=2", "--n_head=2", "--n_embd=32",
                "--block_size=48", "--batch_size=8", "--max_iters=120", "--eval_interval=60", "--eval_iters=2",
                "--log_interval=1000", "--warmup_iters=10", "--learning_rate=3e-3"])
    return out
