"""A GPT-2 with speculative streams (Bhendawade et al., 2024, arXiv 2402.11131).

The main stream is an ordinary causal GPT-2 (paper Eq. 1). At the input of layer
N - Ns every main token M_t gets gamma extra tokens, its *speculative streams*
S_{t,j} = M_t + P_j (Eq. 3), where P is the learned stream identifier embedding.
In the top Ns layers, *multi-stream attention* (Eq. 2) lets stream j at t attend to
the main stream at positions <= t and to streams 1..j at t; the main stream never
attends to a stream, so its outputs do not depend on the streams at all. Every weight
(blocks, final LayerNorm, LM head) is shared: S_{t,j} predicts x_{t+1+j} through the
same head with which M_t predicts x_{t+1}. The only parameters that exist for drafting
are the gamma x d entries of P.

One forward serves training and decoding. Its input is a set of main *nodes* (a
chain for training, a tree draft for decoding) with an attention mask built from
parent pointers (masks.py), plus the indices of the nodes that carry streams.
With a `KVCache` (kvcache.py) the main keys/values of the nodes are appended after the cached
prefix; streams are never cached, they read the main stream's cache. The forward is
split at stream insertion (`forward_bottom`, `forward_top`) so that parallel tree
pruning (§3.2.3, pruning.py) can drop nodes half-way through a pass.

Around the method: stream-only low-rank adapters for the lossless mode of the EMNLP
version (`StreamAdapter`), and the paper's baseline drafter, Medusa heads (`MedusaHead`).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kvcache import KVCache
from .masks import attention_mask
from .pruning import PruningAdapter


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in Linear and LayerNorm
    n_streams: int = 3  # gamma: speculative streams; 0 makes this a plain GPT-2
    n_msa_layers: int = 2  # Ns: top layers with multi-stream attention
    stream_loss_weight: float = 0.1  # alpha_j of Eq. 5 (alpha_0 = 1 for the main stream)
    stream_targets: str = "data"  # what stream j at t learns: "data" (x_{t+1+j}, Eq. 5), "main" (the main stream at
    # t+j) or "greedy" (the main stream at the j-th token of its own greedy continuation from t)
    stream_stride: int = 1  # training: streams at every k-th position (random offset per batch); 1 = all, as the paper
    stream_adapter_rank: int = 0  # > 0: low-rank adapters for stream rows in the MSA layers (lossless mode)
    n_medusa_heads: int = 0  # K: the Medusa baseline drafter instead of streams (n_streams must be 0)
    prune_adapter_rank: int = 0  # > 0: parallel tree pruning adapter at layer N - Ns (paper: 8)
    gelu_approximate: str = "tanh"  # "tanh": GPT-2's GELU; "none": the exact erf GELU of nanoGPT (ss_mini/nanogpt.py)

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
        """How many future tokens the drafter proposes per position (gamma or K)."""
        return self.n_streams or self.n_medusa_heads


class Linear(nn.Linear):
    """nn.Linear, with one measured exception for decoding on a CPU: a weight of 2^18 or more
    entries times 2 to 64 rows (a pass over a tree draft) is computed as (W x^T)^T, the same
    product in the orientation that CPU BLAS (MKL here) runs fastest for few rows: at GPT-2
    width and 4 rows, 1.3-2.2x faster per layer, and the LM head takes 7 ms instead of 27 ms
    (README, "What one step costs"). The result is copied back to row-major, F.linear's
    layout, because the ops after it are fast only there: the next layer's product in this
    orientation took 3x longer on a transposed input, and SDPA leaves its fused kernel for
    a slow one when q, k, v come strided (a GPT-2-shaped pass over 4 nodes: 50 -> 40 ms).
    One row (a matrix-vector product) and training's thousands of rows gain nothing; small
    weights would lose more to the extra reshapes than they gain. All of them keep F.linear."""

    def forward(self, x):
        # the size test first: for small weights (every layer of the default model) it is the only one
        if self.in_features * self.out_features >= 1 << 18 and x.device.type == "cpu":
            rows = x.numel() // self.in_features
            if 1 < rows <= 64:
                y = torch.mm(self.weight, x.reshape(rows, self.in_features).T).T.contiguous()  # row-major again
                y = y.view(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class StreamAdapter(nn.Module):
    """A low-rank update of a shared linear layer for the stream rows only (lossless mode,
    EMNLP version): linear(x) for the n main rows, linear(x) + up(down(x)) for the streams.
    The main rows never pass through it, so a frozen base keeps its main stream exactly."""

    def __init__(self, d_in, d_out, rank):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)  # zero-initialised by GPT: the update starts at zero

    def forward(self, linear, x, n):
        y = linear(x)
        y[:, n:] += self.up(self.down(x[:, n:]))  # in place: no copy of the main rows (linear's backward needs x, not y)
        return y


def dropout(x, p, training):
    """Dropout that costs nothing when off (no op at all, not even an identity module call)."""
    return F.dropout(x, p, True) if p and training else x


class MultiStreamAttention(nn.Module):
    """Causal self-attention of the main stream plus multi-stream attention (Eq. 2), in one
    call: queries are the n main rows and the stream rows, keys are [cached prefix; main
    rows; stream rows], and the mask from `attention_mask` keeps every main row away from
    the streams (so the main stream never sees one) and gives each stream row what Eq. 2
    allows. At decode time this is one small call instead of two and no concatenation.
    """

    def __init__(self, config, msa=False):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        r = config.stream_adapter_rank if msa and config.n_streams else 0
        self.stream_adapter = StreamAdapter(config.n_embd, 3 * config.n_embd, r) if r else None
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x, n, mask, cache, layer):
        B, T, C = x.shape
        qkv = self.c_attn(x) if self.stream_adapter is None or T == n else self.stream_adapter(self.c_attn, x, n)
        qkv = qkv.view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k, v = qkv
        if cache is not None:  # keys and values of the cached prefix and of this pass's rows
            k, v = cache.write(layer, qkv[1:])
        # mask=None: every row sees every key (a one-token step without streams)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)
        return dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config, msa=False):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        r = config.stream_adapter_rank if msa and config.n_streams else 0
        self.stream_adapter = StreamAdapter(config.n_embd, 4 * config.n_embd, r) if r else None
        self.gelu = nn.GELU(approximate=config.gelu_approximate)  # GPT-2's tanh form by default
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x, n):
        h = self.c_fc(x) if self.stream_adapter is None or x.shape[1] == n else self.stream_adapter(self.c_fc, x, n)
        return dropout(self.c_proj(self.gelu(h)), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LayerNorm transformer block. Main and stream rows share every weight, so
    all per-token work runs on them as one sequence; only attention tells them apart."""

    def __init__(self, config, msa=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiStreamAttention(config, msa)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, msa)

    def forward(self, x, n, mask, cache, layer):
        x = x + self.attn(self.ln_1(x), n, mask, cache, layer)
        return x + self.mlp(self.ln_2(x), n)


class MedusaHead(nn.Module):
    """The Medusa baseline (Cai et al., 2024): a residual SiLU block and an LM head of its
    own on the last main hidden state; head k predicts x_{t+1+k}. d^2 + d + d*V
    parameters per head, against gamma*d for all the streams together."""

    def __init__(self, config):
        super().__init__()
        self.res = Linear(config.n_embd, config.n_embd)  # zero-initialised by GPT: starts as the identity
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)  # a copy of the base head at start

    def forward(self, h):
        return self.lm_head(h + F.silu(self.res(h)))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
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
                nn.init.zeros_(p)
        if config.n_streams:
            nn.init.normal_(self.stream_emb, mean=0.0, std=0.02)
        self.init_medusa_heads()
        self._train_masks = {}

    @torch.no_grad()
    def init_medusa_heads(self):
        """Medusa's initialisation: identity residual blocks and copies of the base LM head."""
        for head in getattr(self, "medusa_heads", []):
            nn.init.zeros_(head.res.weight), nn.init.zeros_(head.res.bias)
            head.lm_head.weight.copy_(self.lm_head.weight)

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
        """GPT-2 weights from local Hugging Face files (see ss_mini/pretrained.py)."""
        from .pretrained import load_gpt2
        return load_gpt2(spec, **stream_args)

    def forward_nodes(self, idx, pos, mask=None, cache=None, stream_idx=None, n_drafts=None, last_only=False):
        """Run main nodes idx (B, n) at positions pos (n,) and the streams of some of them.

        mask: from `attention_mask` for these nodes (and their streams, if any run), with the
        cached prefix as its first columns; None for one node that sees every key.
        stream_idx: the nodes that carry streams (None = all). n_drafts: how many streams run,
        the first ones (None = all gamma; 0 = none, a plain pass). Stream j attends to streams
        <= j only (Eq. 2), so the first g streams come out the same whatever g is: a tree draft
        D deep needs D of them, and a pass pays for no more (Medusa: 0 = no drafts, else all K).
        Returns the main logits (B, n, V) (only the last node's with last_only) and the
        drafter's hidden states (B, m, g, d) for the streams, (B, m, d) for Medusa, or
        None: `draft_logits` turns them into draft logits. The LM head runs on the main rows
        only, so a pass pays for draft logits only where they are used (the accepted node).
        """
        x = self.forward_bottom(idx, pos, mask, cache, n_drafts)
        return self.forward_top(x, mask, stream_idx, cache, n_drafts, last_only)

    def streams_in_pass(self, n_drafts):
        """How many streams a pass with this n_drafts runs."""
        g = self.config.n_streams
        return g if n_drafts is None else min(g, n_drafts)

    def first_msa_layer(self, g):
        """The first layer of a pass that runs g streams (n_layer: none, all layers are plain)."""
        cfg = self.config
        return cfg.n_layer - cfg.n_msa_layers if g else cfg.n_layer

    def forward_bottom(self, idx, pos, mask=None, cache=None, n_drafts=None):
        """Embeddings and the layers below stream insertion: main rows only."""
        n = idx.shape[1]
        x = dropout(self.transformer.wte(idx) + self.transformer.wpe(pos), self.config.dropout, self.training)
        if mask is not None:  # the main rows' part: the prefix and the nodes, no stream keys
            mask = mask[:n, :mask.shape[1] - mask.shape[0] + n]
        for i in range(self.first_msa_layer(self.streams_in_pass(n_drafts))):
            x = self.transformer.h[i](x, n, mask, cache, i)
        return x

    def forward_top(self, x, mask=None, stream_idx=None, cache=None, n_drafts=None, last_only=False):
        """Stream insertion, the multi-stream attention layers and the heads (see forward_nodes)."""
        cfg = self.config
        n, g = x.shape[1], self.streams_in_pass(n_drafts)
        if g:  # stream insertion, Eq. 3: S_{t,j} = M_t + P_j
            src = x if stream_idx is None else x[:, stream_idx]
            x = torch.cat([x, (src.unsqueeze(2) + self.stream_emb[:g]).flatten(1, 2)], dim=1)
            if mask is None:  # one node: it sees every key, its streams see it and their lower streams
                L = cache.length if cache is not None else 0
                mask = attention_mask([-1], g, L, dtype=x.dtype, device=x.device)
        for i in range(self.first_msa_layer(g), cfg.n_layer):
            x = self.transformer.h[i](x, n, mask, cache, i)
        x = self.transformer.ln_f(x)
        drafts = None
        if g:
            drafts = x[:, n:].unflatten(1, (-1, g))
        elif cfg.n_medusa_heads and n_drafts != 0:  # Medusa drafts from the main hidden states
            drafts = x[:, :n] if stream_idx is None else x[:, stream_idx]
        main = x[:, n - 1:n] if last_only else x[:, :n]
        return self.lm_head(main), drafts

    def draft_logits(self, h):
        """Draft logits from the drafter's hidden states (see forward_nodes): the shared LM
        head for stream rows (B.., gamma, d) -> (B.., gamma, V); Medusa's heads for main
        rows (B.., d) -> (B.., K, V)."""
        if self.config.n_medusa_heads:
            return torch.stack([head(h) for head in self.medusa_heads], dim=-2)
        return self.lm_head(h)

    def _chain_masks(self, T, device, where=None):
        """Training is the decoding mask rule applied to a chain: built once per length (and
        per set of positions that carry streams, `where`; None = all)."""
        key = (T, device, where and (where.start, where.step))
        if key not in self._train_masks:
            self._train_masks[key] = attention_mask(range(-1, T - 1), self.config.n_streams,
                                                    stream_idx=where and list(where), device=device)
        return self._train_masks[key]

    def forward(self, idx, targets=None):
        """Training forward over a chain: returns (main logits, draft logits, losses).

        losses (when targets are given): 'loss' = Eq. 5, CE(main) + sum_j alpha_j CE(stream j)
        (+ alpha CE of the pruning adapter's early logits), 'main', 'streams' (a list) and
        'prune' for logging. targets[b, t] = x_{t+1}; stream j at t is
        trained on targets[b, t+j], and positions past the end are ignored.

        stream_targets="main" trains stream j at t on the main stream's own distribution at
        t+j instead (soft cross-entropy; the teacher is detached, a target that is never
        pulled toward the streams): self-distillation, as Medusa-2 and EAGLE train their
        drafters. Verification accepts a draft when it is the main stream's token, not the
        data's, so this is closer to what decides acceptance, and a distribution carries
        more signal per position than one token. stream_targets="greedy" goes one step
        further: the main stream's distribution at the j-th token of its own greedy
        continuation from t (`greedy_continuation`), which is what greedy verification
        checks. 'streams' still reports the CE against the data, so all kinds compare.

        stream_stride=k > 1 (training mode only): streams run at positions offset, offset + k,
        ... (offset drawn per batch), so the multi-stream layers carry T + gamma*T/k rows
        instead of (1 + gamma)*T: the training step is cheaper, every position is still
        trained over the batches, and the main stream is unchanged (it never sees a stream).
        The draft logits then cover those positions only. In eval mode every position runs.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
        k = self.config.stream_stride if self.training and self.config.n_drafts else 1
        offset = int(torch.randint(k, ())) if k > 1 else 0
        where = None if k == 1 else range(offset, T, k)  # the positions that carry streams
        pos = torch.arange(T, device=idx.device)
        mask = self._chain_masks(T, idx.device, where)
        h = self.forward_bottom(idx, pos, mask)
        main, drafts = self.forward_top(h, mask, where and list(where))
        stream = self.draft_logits(drafts) if drafts is not None else None
        if targets is None:
            return main, stream, None
        V = main.shape[-1]
        main_loss = F.cross_entropy(main.reshape(-1, V), targets.reshape(-1), ignore_index=-1)
        loss, stream_losses = main_loss, []
        greedy = None
        if self.config.stream_targets == "greedy" and self.config.n_drafts:
            greedy = self.greedy_continuation(idx, where)
        for j in range(1, self.config.n_drafts + 1):
            t = torch.arange(offset, T - j, k, device=idx.device)  # stream j at t has a target, x_{t+1+j}, if t + j < T
            s = stream[:, :len(t), j - 1]  # the positions rise, so those are the first len(t)
            lj = F.cross_entropy(s.reshape(-1, V), targets[:, t + j].reshape(-1), ignore_index=-1)
            stream_losses.append(lj)
            if self.config.stream_targets != "data":  # soft targets: the main stream at t+j, or along its greedy path
                teacher = greedy[:, :len(t), j - 1] if greedy is not None else torch.softmax(main[:, t + j].detach().float(), -1)
                lj = -(teacher * F.log_softmax(s.float(), dim=-1)).sum(-1).mean()
            loss = loss + self.config.stream_loss_weight * lj
        losses = {"main": main_loss, "streams": stream_losses}
        if self.config.prune_adapter_rank:  # the pruning adapter learns the next token at layer N - Ns
            early = self.prune_adapter.early_logits(self, h)
            losses["prune"] = F.cross_entropy(early.reshape(-1, V), targets.reshape(-1), ignore_index=-1)
            loss = loss + self.config.stream_loss_weight * losses["prune"]
        return main, stream, {"loss": loss, **losses}

    @torch.no_grad()
    def greedy_continuation(self, idx, where=None):
        """The targets of stream_targets="greedy" (B, m, gamma, V): for each position t in
        `where` (m of them; None = every position), the main stream's distributions over the
        first gamma tokens of its own greedy continuation from t.

        Greedy verification accepts stream j's draft at t when it is the main stream's
        argmax after the tokens before it, and in a pass where the earlier drafts were
        accepted those tokens are the main stream's own argmaxes, not the data's. Teacher
        forcing with the data ("main") only approximates that; this computes it. It is a
        tree of main nodes over the batch, run with a KV cache like a decoding pass: the
        chain idx, then gamma levels, where level j holds, for every t, the argmax of level
        j - 1 at position t + j (its parent; past the block the position is clamped, and
        those targets are never used). One pass per level, m rows each: a training step
        pays about one forward of the batch plus gamma forwards of m rows per sequence, and
        holds B x m x gamma x V probabilities (mind GPT-2's vocabulary: lower batch_size).
        """
        B, T = idx.shape
        dev, g = idx.device, self.config.n_drafts
        t = torch.arange(T, device=dev) if where is None else torch.tensor(list(where), device=dev)
        m = len(t)
        key = ("greedy", T, dev, where and (where.start, where.step))
        if key not in self._train_masks:  # the chain, then level j: parent t (j = 1) or the node of level j - 1
            parents = list(range(-1, T - 1)) + t.tolist() + [T + i for i in range((g - 1) * m)]
            self._train_masks[key] = attention_mask(parents, device=dev)
        mask = self._train_masks[key]
        cache = KVCache(self.config, T + g * m, batch_size=B, device=dev, dtype=self.lm_head.weight.dtype)
        logits, _ = self.forward_nodes(idx, torch.arange(T, device=dev), mask[:T, :T], cache=cache, n_drafts=0)
        cache.accept(T)
        y, probs = logits[:, t].argmax(-1), []
        for j in range(1, g + 1):
            end = T + j * m
            logits, _ = self.forward_nodes(y, (t + j).clamp(max=T - 1), mask[end - m:end, :end], cache=cache, n_drafts=0)
            cache.accept(m)
            probs.append(torch.softmax(logits.float(), dim=-1))
            y = logits.argmax(-1)
        return torch.stack(probs, dim=2)

    def configure_optimizer(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]  # matrices decay; biases, norms and P do not
        no_decay = [p for p in params if p.dim() < 2 or p is getattr(self, "stream_emb", None)]
        decay = [p for p in decay if all(p is not q for q in no_decay)]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")
