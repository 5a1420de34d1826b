"""A GPT-2 with speculative streams (Bhendawade et al., 2024, arXiv 2402.11131).

The main stream is an ordinary causal GPT-2 (paper Eq. 1). After layer N - Ns (layers
counted from 1) every main token M_t gets gamma extra tokens, its *speculative streams*
S_{t,j} = M_t + P_j (Eq. 3), where P is the learned stream identifier embedding. In the
top Ns layers, *multi-stream attention* (Eq. 2) lets stream j at t attend to the main
stream at positions <= t and to streams 1..j at t; the main stream never attends to a
stream, so its outputs do not depend on the streams at all. Every weight (blocks, final
LayerNorm, LM head) is shared: S_{t,j} predicts x_{t+1+j} through the same head with
which M_t predicts x_{t+1}. Training minimises Eq. 5 (`GPT.forward`).

One forward serves training and decoding. Its input is a set of main *nodes* (a chain
for training, a tree draft for decoding) with an attention mask built from parent
pointers (masks.py), plus the nodes that carry streams. With a `KVCache` (kvcache.py) the
main keys/values of the nodes are appended after the cached prefix; the stream rows'
follow them for the pass's own attention and are never kept (`KVCache.accept`): a stream
reads the main stream's cache. The forward is split at stream insertion
(`forward_bottom`, `forward_top`) so that parallel tree pruning (pruning.py) can drop
nodes half-way through a pass.

Around the method, each in its own file: stream-only adapters of the lossless mode
(adapters.py, called in the attention and MLP of the MSA layers), Medusa heads, the paper's
baseline drafter (medusa.py: built in __init__, run in forward_top), the tree-pruning adapter
(pruning.py: built in __init__, trained in forward), distilled stream targets (distill.py,
in forward) and the device-specific kernel choices (kernels.py: Linear, HEAD_ROWS).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .extras.adapters import stream_adapter
from .extras.distill import stream_teacher
from .extras.kernels import HEAD_ROWS, Linear
from .masks import attention_mask
from .extras.medusa import MedusaHead, init_medusa_heads, medusa_logits
from .extras.pruning import PruningAdapter


@dataclass
class GPTConfig:
    """The model's shape and its streams. These defaults are a small model for code that builds
    one directly; the README's default model is train.py's config (gamma = 4 as in the paper's
    Table 1, Ns = 1, alpha = 0.3: docs/defaults.md)."""
    block_size: int = 256
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in Linear and LayerNorm
    n_streams: int = 3  # gamma: speculative streams; 0 makes this a plain GPT-2
    n_msa_layers: int = 2  # Ns: top layers with multi-stream attention
    stream_loss_weight: float = 0.1  # alpha_j of Eq. 5, one for all streams (alpha_0 = 1 for the main stream)
    stream_targets: str = "data"  # what stream j at t learns: "data" (x_{t+1+j}, Eq. 5), "main" or "greedy" (distill.py)
    stream_stride: int = 1  # training: streams at every k-th position (random offset per batch); 1 = all, as the paper
    stream_adapter_rank: int = 0  # > 0: stream-only low-rank adapters in the MSA layers (lossless mode, adapters.py)
    n_medusa_heads: int = 0  # K: the Medusa baseline drafter instead of streams (n_streams must be 0)
    prune_adapter_rank: int = 0  # > 0: parallel tree pruning adapter at layer N - Ns (paper: 8)
    gelu_approximate: str = "tanh"  # "tanh": GPT-2's GELU; "none": the exact erf GELU of nanoGPT (ss_mini/io/nanogpt.py)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_streams and self.n_medusa_heads:
            raise ValueError("choose one drafter: n_streams (Speculative Streaming) or n_medusa_heads (Medusa), not both")
        if self.prune_adapter_rank and not self.n_streams:
            raise ValueError("tree pruning (prune_adapter_rank > 0) acts before stream insertion: it needs n_streams > 0")
        if self.stream_targets not in ("data", "main", "greedy"):
            raise ValueError(f"stream_targets={self.stream_targets!r}: give data, main or greedy")
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError(f"gelu_approximate={self.gelu_approximate!r}: give tanh (GPT-2) or none (exact, nanoGPT)")
        if self.stream_stride < 1:
            raise ValueError(f"stream_stride={self.stream_stride}: give 1 (streams at every position) or more")
        if self.n_streams and not 1 <= self.n_msa_layers <= self.n_layer:
            raise ValueError(f"n_msa_layers={self.n_msa_layers} must be in 1..n_layer={self.n_layer} when n_streams > 0")

    @property
    def n_drafts(self):
        """How many future tokens the drafter proposes per position: gamma streams, or K Medusa heads."""
        return self.n_streams or self.n_medusa_heads


class MultiStreamAttention(nn.Module):
    """Causal self-attention of the main stream and multi-stream attention (Eq. 2) in one call.

    Queries are the n_main main rows and the stream rows after them; keys are [cached prefix;
    main rows; stream rows]. The mask (masks.py) keeps every main row away from the streams
    and gives each stream row what Eq. 2 allows, so one small call serves both."""

    def __init__(self, config, msa=False):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.stream_adapter = stream_adapter(config, config.n_embd, 3 * config.n_embd, msa)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, n_main, mask, cache, layer):
        B, T, C = x.shape
        qkv = self.c_attn(x)
        if self.stream_adapter is not None:
            qkv = self.stream_adapter(x, qkv, n_main)
        qkv = qkv.view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # (B, H, T, hd) each
        if cache is not None:  # keys and values of the cached prefix and of this pass's rows
            k, v = cache.write(layer, qkv[:, :, 1:])
        # mask=None: every row sees every key (one token, no streams)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        y = self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return self.resid_dropout(y) if self.training else y  # decoding skips the call: no dropout to do


class MLP(nn.Module):
    def __init__(self, config, msa=False):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.stream_adapter = stream_adapter(config, config.n_embd, 4 * config.n_embd, msa)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)  # GPT-2's tanh form by default
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
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

    def __init__(self, config, msa=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiStreamAttention(config, msa)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, msa)

    def forward(self, x, n_main, mask, cache, layer):
        x = x + self.attn(self.ln_1(x), n_main, mask, cache, layer)
        return x + self.mlp(self.ln_2(x), n_main)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, msa=i >= config.n_layer - config.n_msa_layers) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2
        if config.n_streams:
            self.stream_emb = nn.Parameter(torch.zeros(config.n_streams, config.n_embd))  # P of Eq. 3
        if config.n_medusa_heads:
            self.medusa_heads = nn.ModuleList([MedusaHead(config) for _ in range(config.n_medusa_heads)])
        if config.prune_adapter_rank:
            self.prune_adapter = PruningAdapter(config.n_embd, config.prune_adapter_rank)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            elif name.endswith(("stream_adapter.up.weight", "prune_adapter.up.weight")):
                nn.init.zeros_(p)  # adapters start as the identity
        if config.n_streams:
            nn.init.normal_(self.stream_emb, mean=0.0, std=0.02)
        init_medusa_heads(self)
        self._chain_mask_cache = {}

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @staticmethod
    def is_draft_param(name):
        """Parameters that exist only for drafting: stream embeddings P, stream adapters, Medusa
        heads, the pruning adapter."""
        return (name == "stream_emb" or ".stream_adapter." in name
                or name.startswith(("medusa_heads.", "prune_adapter.")))

    def param_counts(self):
        """(base, draft) parameter counts."""
        draft = sum(p.numel() for name, p in self.named_parameters() if self.is_draft_param(name))
        return sum(p.numel() for p in self.parameters()) - draft, draft

    def crop_block_size(self, block_size):
        """Keep only the first block_size learned positions (e.g. GPT-2's 1024 -> 128)."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].detach().clone())

    @classmethod
    def from_pretrained(cls, spec, **stream_args):
        """GPT-2 weights from local Hugging Face files (see ss_mini/io/pretrained.py)."""
        from .io.pretrained import load_gpt2
        return load_gpt2(spec, **stream_args)

    # ------------------------------------------------------------------ the forward pass

    def streams_in_pass(self, draft_depth):
        """How many streams a pass runs. draft_depth, wherever it is passed: None = all gamma,
        0 = none (a plain pass), g = the first g. Stream j attends to streams <= j only (Eq. 2),
        so the first g come out the same whatever g is: a tree draft D deep needs D of them.
        For Medusa, 0 means no drafts and anything else all K heads."""
        g = self.config.n_streams
        return g if draft_depth is None else min(g, draft_depth)

    def first_msa_layer(self, g):
        """The first layer of a pass that runs g streams (n_layer: none, all layers are plain)."""
        cfg = self.config
        return cfg.n_layer - cfg.n_msa_layers if g else cfg.n_layer

    def forward_nodes(self, idx, pos, mask=None, cache=None, stream_idx=None, draft_depth=None, main_idx=None):
        """Run main nodes idx (B, n) at positions pos ((B, n) or (n,)) and the streams of some of them.

        mask: the pass's attention mask (masks.py): over the pass's own rows [n main nodes; their
        stream rows] without a cache (training), over all the cache's slots with one
        (decoding, `KVCache.mask`). stream_idx: the nodes that carry streams, (m,) or (B, m) per
        row (None = all). draft_depth: see `streams_in_pass`. main_idx: the main rows whose logits
        are wanted, (k,) or (B, k) (None = all).
        Returns (main logits (B, k, V), draft logits (B, m, g, V): the g streams' logits at
        each streamed node; or Medusa's K heads there; None when the pass drafts nothing).
        Main and stream rows share the LM head: when there are at most kernels.HEAD_ROWS of
        them, one call gives all their logits, reading the head once as an autoregressive step
        does (kernels.py).
        """
        x = self.forward_bottom(idx, pos, mask, cache, draft_depth)
        return self.forward_top(x, mask, stream_idx=stream_idx, cache=cache, draft_depth=draft_depth, main_idx=main_idx)

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

    def forward_top(self, x, mask=None, stream_idx=None, cache=None, draft_depth=None, main_idx=None):
        """Stream insertion (Eq. 3), the multi-stream attention layers (Eq. 2) and the heads."""
        cfg = self.config
        n, g = x.shape[1], self.streams_in_pass(draft_depth)
        if g:  # stream insertion, Eq. 3 (f_eta = identity): S_{t,j} = M_t + P_j
            x = torch.cat([x, (_rows(x, stream_idx).unsqueeze(2) + self.stream_emb[:g]).flatten(1, 2)], dim=1)
        for i in range(self.first_msa_layer(g), cfg.n_layer):
            x = self.transformer.h[i](x, n, mask, cache, i)
        x = self.transformer.ln_f(x)
        main = _rows(x[:, :n], main_idx)
        if g:  # the stream rows follow the main rows: one head call for a few rows (kernels.py)
            k, streams = main.shape[1], x[:, n:]
            if k + streams.shape[1] > HEAD_ROWS:
                return self.lm_head(main), self.lm_head(streams).unflatten(1, (-1, g))
            logits = self.lm_head(x if main_idx is None else torch.cat([main, streams], dim=1))
            return logits[:, :k], logits[:, k:].unflatten(1, (-1, g))
        if cfg.n_medusa_heads and draft_depth != 0:  # Medusa drafts from the main hidden states
            return self.lm_head(main), medusa_logits(self, _rows(x, stream_idx))
        return self.lm_head(main), None

    # ------------------------------------------------------------------ training (Eq. 5)

    def chain_mask(self, T, device, where=None):
        """Training is the decoding mask rule applied to a chain: built once per length and per
        set of positions that carry streams (`where`, None = all)."""
        key = (T, device, where and (where.start, where.step))
        if key not in self._chain_mask_cache:
            self._chain_mask_cache[key] = attention_mask(range(-1, T - 1), self.config.n_streams,
                                                         stream_idx=where and list(where), device=device)
        return self._chain_mask_cache[key]

    def forward(self, idx, targets=None):
        """Training forward over a chain: returns (main logits, draft logits, losses).

        losses (when targets are given): 'loss' = Eq. 5, CE(main) + sum_j alpha_j CE(stream j),
        'main' and 'streams' (a list, CE against the data whatever the targets) for logging, and
        'prune' with a pruning adapter. targets[b, t] = x_{t+1}; stream j at t learns x_{t+1+j}
        = targets[b, t+j] (stream_targets="data", the paper's) or the main stream's own
        distribution there (distill.py); positions past the end and targets of -1 (padding) are
        ignored, and a stream left with no target adds 0.

        stream_stride=k > 1 (training mode only): streams run at positions offset, offset + k,
        ... (offset drawn per batch), so the multi-stream layers carry T + gamma*T/k rows
        instead of (1 + gamma)*T; every position is still trained over the batches, and the
        main stream is unchanged (it never sees a stream). In eval mode every position runs.
        """
        cfg = self.config
        B, T = idx.shape
        if T > cfg.block_size:
            raise ValueError(f"sequence length {T} > block_size {cfg.block_size}")
        k = cfg.stream_stride if self.training and cfg.n_drafts else 1
        offset = int(torch.randint(min(k, T), ())) if k > 1 else 0  # below T: some position carries streams
        where = None if k == 1 else range(offset, T, k)  # the positions that carry streams
        mask = self.chain_mask(T, idx.device, where)
        h = self.forward_bottom(idx, torch.arange(T, device=idx.device), mask)
        main_logits, draft_logits = self.forward_top(h, mask, where and list(where))
        if targets is None:
            return main_logits, draft_logits, None
        V = main_logits.shape[-1]
        main_loss = F.cross_entropy(main_logits.reshape(-1, V), targets.reshape(-1), ignore_index=-1)
        loss, stream_losses = main_loss, []
        teacher = stream_teacher(self, idx, main_logits, where) if cfg.n_drafts else None
        for j in range(1, cfg.n_drafts + 1):
            t = torch.arange(offset, max(offset, T - j), k, device=idx.device)  # a target if t + j < T
            s, y = draft_logits[:, :len(t), j - 1], targets[:, t + j]  # positions rise: those with a target first
            valid = y != -1  # padding trains no stream, as it trains no main position
            n = valid.sum().clamp(min=1)  # a stream with no target at all adds 0, not the NaN of an empty mean
            lj = F.cross_entropy(s.reshape(-1, V), y.reshape(-1), ignore_index=-1, reduction="sum") / n
            stream_losses.append(lj)
            if teacher is not None:  # soft targets: the main stream's distributions (distill.py)
                lj = -((teacher(j, t) * F.log_softmax(s.float(), dim=-1)).sum(-1) * valid).sum() / n
            loss = loss + cfg.stream_loss_weight * lj
        losses = {"main": main_loss, "streams": stream_losses}
        if cfg.prune_adapter_rank:  # the pruning adapter learns the next token at layer N - Ns
            early = self.prune_adapter.early_logits(self, h)
            losses["prune"] = F.cross_entropy(early.reshape(-1, V), targets.reshape(-1), ignore_index=-1)
            loss = loss + cfg.stream_loss_weight * losses["prune"]
        return main_logits, draft_logits, {"loss": loss, **losses}

    def configure_optimizer(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]  # matrices decay; biases, norms and P do not
        no_decay = [p for p in params if p.dim() < 2 or p is getattr(self, "stream_emb", None)]
        decay = [p for p in decay if all(p is not q for q in no_decay)]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def _rows(x, idx):
    """x (B, n, d) at rows idx: None = all, (m,) or a list = the same rows of every batch row,
    (B, m) = its own rows for each."""
    if idx is None:
        return x
    if isinstance(idx, list) or idx.dim() == 1:
        return x[:, idx]
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
