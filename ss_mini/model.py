"""A GPT-2 with speculative streams (Bhendawade et al., 2024, arXiv 2402.11131).

The main stream is an ordinary causal GPT-2 (paper Eq. 1). After layer N - Ns (layers counted
from 1) every main token M_t gets gamma extra tokens, its *speculative streams* S_{t,j} = M_t + P_j
(Eq. 3), where P is the learned stream identifier embedding. In the top Ns layers, *multi-stream
attention* (Eq. 2) lets stream j at t attend to the main stream at positions <= t and to streams
1..j at t; the main stream never attends to a stream, so its outputs do not depend on the streams
at all. Every weight (blocks, final LayerNorm, LM head) is shared: S_{t,j} predicts x_{t+1+j}
through the same head with which M_t predicts x_{t+1}. Training minimises Eq. 5 (`GPT.forward`).

One forward serves training and decoding (`forward_nodes`): a set of main *nodes* (a chain
when training, a tree draft when decoding) with the attention mask of masks.py, plus the
streams of some nodes. With a `KVCache` the nodes' keys and values go after the cached
prefix; the stream rows' serve the pass itself and lie past the row's length, never
accepted: a stream reads the main stream's cache. The forward is split at stream insertion
(`forward_bottom`, `forward_top`), where parallel tree pruning acts (extras/pruning.py).

Extensions subclass GPT in ss_mini/extras/ (Medusa heads, the pruning adapter, the lossless
mode's stream-only adapters), built by `ss_mini.build_model`.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kvcache import KVCache
from .loss import train_forward


@dataclass
class GPTConfig:
    """The model's shape and its streams. These defaults are a small model for code that
    builds one directly; the README's default model is train.py's config."""
    block_size: int = 256
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in Linear and LayerNorm
    n_streams: int = 3  # gamma: speculative streams; 0 makes this a plain GPT-2
    n_msa_layers: int = 2  # Ns: top layers with multi-stream attention
    stream_loss_weight: float = 0.1  # alpha_j of Eq. 5, one for all streams (alpha_0 = 1)
    stream_targets: str = "data"  # "data": x_{t+1+j} (Eq. 5); "main", "greedy": extras/distill.py
    stream_stride: int = 1  # training: streams at every k-th position; 1 = all, as the paper
    stream_adapter_rank: int = 0  # > 0: stream-only adapters, lossless mode (extras/lossless.py)
    n_medusa_heads: int = 0  # K: the Medusa baseline instead of streams (extras/medusa.py)
    prune_adapter_rank: int = 0  # > 0: parallel tree pruning adapter (extras/pruning.py)
    gelu_approximate: str = "tanh"  # "tanh": GPT-2's GELU; "none": nanoGPT's exact erf GELU

    def __post_init__(self):
        for bad, message in [
            (self.n_embd % self.n_head, f"n_embd={self.n_embd} must be divisible by n_head"),
            (self.n_streams and self.n_medusa_heads, "choose one drafter: n_streams or "
             "n_medusa_heads (Medusa)"),
            (self.prune_adapter_rank and not self.n_streams, "tree pruning acts before stream "
             "insertion: prune_adapter_rank > 0 needs n_streams > 0"),
            (self.stream_targets not in ("data", "main", "greedy"),
             f"stream_targets={self.stream_targets!r}: give data, main or greedy"),
            (self.gelu_approximate not in ("tanh", "none"),
             f"gelu_approximate={self.gelu_approximate!r}: give tanh (GPT-2) or none (nanoGPT)"),
            (self.stream_stride < 1, f"stream_stride={self.stream_stride}: give 1 or more"),
            (self.n_streams and not 1 <= self.n_msa_layers <= self.n_layer,
             f"n_msa_layers={self.n_msa_layers} must be in 1..n_layer when n_streams > 0")]:
            if bad:
                raise ValueError(message)

    @property
    def n_drafts(self):
        """Future tokens drafted per position: gamma streams, or K Medusa heads."""
        return self.n_streams or self.n_medusa_heads


class MultiStreamAttention(nn.Module):
    """Causal self-attention of the main stream and multi-stream attention (Eq. 2) in one call:
    queries are the main rows, then the stream rows; the mask (masks.py) keeps the main rows
    away from the streams and gives each stream row what Eq. 2 allows."""

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.add_module("stream_adapter", None)  # lossless mode's (extras/lossless.py)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, n_main, mask, cache, layer):
        B, T, C = x.shape
        qkv = self.c_attn(x)
        if self.stream_adapter is not None:
            qkv = self.stream_adapter(x, qkv, n_main)
        qkv = qkv.view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # (B, H, T, hd) each
        if cache is not None:  # the cached prefix's keys and values, then this pass's
            k, v = cache.write(layer, qkv[:, :, 1:])
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return self.resid_dropout(y) if self.training else y  # decoding skips a module call


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.add_module("stream_adapter", None)  # lossless mode's (extras/lossless.py)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, n_main):
        h = self.c_fc(x)
        if self.stream_adapter is not None:
            h = self.stream_adapter(x, h, n_main)
        y = self.c_proj(self.gelu(h))
        return self.dropout(y) if self.training else y


class Block(nn.Module):
    """Pre-LayerNorm transformer block. Main and stream rows share every weight, so all
    per-token work runs on them as one sequence; only attention tells them apart."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiStreamAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, n_main, mask, cache, layer):
        x = x + self.attn(self.ln_1(x), n_main, mask, cache, layer)
        return x + self.mlp(self.ln_2(x), n_main)


class GPT(nn.Module):
    cache_class = KVCache  # decoding's KV cache (extras/kernels.py `make_lean`: a CPU's leaner one)

    def __init__(self, config):
        super().__init__()
        if type(self) is GPT and (config.n_medusa_heads or config.prune_adapter_rank
                                  or config.stream_adapter_rank):
            raise ValueError("Medusa heads and the adapters are extensions: build the model "
                             "with ss_mini.build_model(config)")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2
        if config.n_streams:
            self.stream_emb = nn.Parameter(torch.zeros(config.n_streams, config.n_embd))  # P
        self._masks = {}  # training's pass masks, by length and positions with streams
        self.kv_memory = {}  # the decoders' KV cache tensors, by size: reused (kvcache.py)
        self.init_weights()

    def init_weights(self):
        """GPT-2's initialisation."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
        if self.config.n_streams:
            nn.init.normal_(self.stream_emb, mean=0.0, std=0.02)

    def streams_in_pass(self, draft_depth):
        """How many streams a pass runs: draft_depth None = all gamma, 0 = none (a plain pass),
        g = the first g. Stream j attends to streams <= j only (Eq. 2), so the first g come
        out the same whatever g is: a tree draft D deep needs D of them."""
        g = self.config.n_streams
        return g if draft_depth is None else min(g, draft_depth)

    def first_msa_layer(self, g):
        """The first layer of a pass that runs g streams (n_layer: none, all layers plain)."""
        return self.config.n_layer - self.config.n_msa_layers if g else self.config.n_layer

    def forward_nodes(self, idx, pos, mask=None, cache=None, stream_idx=None, draft_depth=None,
                      main_idx=None):
        """Run main nodes idx (B, n) at positions pos ((B, n) or (n,)) and the streams of some.

        mask: the pass's mask (masks.py), over its own rows [n main nodes; stream rows] without
        a cache (training), over the cache's slots with one (decoding: `KVCache.mask`).
        stream_idx: the nodes that carry streams, (B, m) (None = all); draft_depth: see
        `streams_in_pass`; main_idx: the main rows whose logits are wanted, (B, k) (None = all).
        Returns (main logits (B, k, V), draft logits (B, m, g, V), or None without drafts)."""
        x = self.forward_bottom(idx, pos, mask, cache, draft_depth)
        return self.forward_top(x, mask, stream_idx, cache, draft_depth, main_idx)

    def forward_bottom(self, idx, pos, mask=None, cache=None, draft_depth=None):
        """Embeddings and the layers below stream insertion: main rows only."""
        n = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        x = self.transformer.drop(x) if self.training else x
        if mask is not None:  # the main rows; without a cache also only their keys
            mask = mask[..., :n, :] if cache is not None else mask[..., :n, :n]
        for i in range(self.first_msa_layer(self.streams_in_pass(draft_depth))):
            x = self.transformer.h[i](x, n, mask, cache, i)
        return x

    def forward_top(self, x, mask=None, stream_idx=None, cache=None, draft_depth=None,
                    main_idx=None):
        """Stream insertion (Eq. 3), the multi-stream attention layers (Eq. 2) and the head."""
        n, g = x.shape[1], self.streams_in_pass(draft_depth)
        if g:  # Eq. 3 with f_eta the identity: S_{t,j} = M_t + P_j
            streams = _rows(x, stream_idx).unsqueeze(2) + self.stream_emb[:g]
            x = torch.cat([x, streams.flatten(1, 2)], dim=1)
        for i in range(self.first_msa_layer(g), self.config.n_layer):
            x = self.transformer.h[i](x, n, mask, cache, i)
        return self.heads(self.transformer.ln_f(x), n, stream_idx, draft_depth, main_idx)

    def heads(self, x, n, stream_idx, draft_depth, main_idx):
        """Logits of the main rows wanted and of every stream row, from one call of the shared
        LM head (a decoding step is memory-bound: one read of the head serves all rows)."""
        g = self.streams_in_pass(draft_depth)
        if main_idx is not None:
            x = torch.cat([_rows(x[:, :n], main_idx), x[:, n:]], dim=1)
            n = main_idx.shape[-1]
        logits = self.lm_head(x)
        return logits[:, :n], (logits[:, n:].unflatten(1, (-1, g)) if g else None)

    def forward(self, idx, targets=None, teacher=None):
        """Training's forward over a chain and its loss (Eq. 5): loss.py's `train_forward`."""
        return train_forward(self, idx, targets, teacher)


def _rows(x, idx):
    """x (B, n, d) at the rows idx (B, m) of each batch row; None = all rows."""
    if idx is None:
        return x
    return x.gather(1, idx.expand(x.shape[0], -1)[..., None].expand(-1, -1, x.shape[-1]))
