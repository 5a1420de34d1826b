"""The paper's baseline drafter, Medusa heads (Cai et al., 2024), on the same GPT.

Head k (k = 1..K) is a residual SiLU block and an LM head of its own on the last main hidden
state, and predicts x_{t+1+k}. Each costs d^2 + d + d*V parameters, against gamma*d for all
the speculative streams together (paper §4, Table 1). The decoders, trees and verification
are the same for both drafters: only where the draft logits come from differs (`heads`).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model import GPT, _rows


class MedusaHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.res = nn.Linear(config.n_embd, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, h):
        return self.lm_head(h + F.silu(self.res(h)))


class MedusaGPT(GPT):
    """A GPT without streams (n_streams = 0) whose K heads draft from the main hidden states."""

    def __init__(self, config):
        super().__init__(config)
        K = config.n_medusa_heads
        self.medusa_heads = nn.ModuleList([MedusaHead(config) for _ in range(K)])
        init_medusa_heads(self)

    def heads(self, x, n, stream_idx, draft_depth, main_idx):
        """The main logits, and the first draft_depth heads' logits (B, m, K', V) at the nodes
        stream_idx (None = all; draft_depth None = all K heads, 0 = none)."""
        main, _ = super().heads(x, n, None, 0, main_idx)
        if draft_depth == 0:
            return main, None
        hidden = _rows(x[:, :n], stream_idx)
        heads = self.medusa_heads[:draft_depth]
        return main, torch.stack([head(hidden) for head in heads], dim=-2)


@torch.no_grad()
def init_medusa_heads(model):
    """Medusa's initialisation: identity residual blocks (zero weights), copies of the base head."""
    for head in getattr(model, "medusa_heads", []):
        nn.init.zeros_(head.res.weight), nn.init.zeros_(head.res.bias)
        head.lm_head.weight.copy_(model.lm_head.weight)
