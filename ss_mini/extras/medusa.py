"""The paper's baseline drafter, Medusa heads (Cai et al., 2024), on the same GPT.

Head k (k = 1..K) is a residual SiLU block and an LM head of its own on the last main hidden
state, and predicts x_{t+1+k}. Each costs d^2 + d + d*V parameters, against gamma*d for all
the speculative streams together (paper §4, Table 1). The same tree builder and verifier
serve both drafters (generate.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels import Linear


class MedusaHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.res = Linear(config.n_embd, config.n_embd)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, h):
        return self.lm_head(h + F.silu(self.res(h)))


@torch.no_grad()
def init_medusa_heads(model):
    """Medusa's initialisation: identity residual blocks (zero weights) and copies of the base LM head."""
    for head in getattr(model, "medusa_heads", []):
        nn.init.zeros_(head.res.weight), nn.init.zeros_(head.res.bias)
        head.lm_head.weight.copy_(model.lm_head.weight)


def medusa_logits(model, hidden):
    """Draft logits (..., K, V) of every head from main hidden states (..., d)."""
    return torch.stack([head(hidden) for head in model.medusa_heads], dim=-2)
