"""Lossless mode (the EMNLP version of the paper): the base model frozen, only the stream
embeddings P and stream-only adapters trained, so the main stream, and every verified token,
stays the base model's bit for bit.

A `StreamAdapter` is a low-rank update of a shared Linear (each multi-stream attention layer's
c_attn and c_fc) applied to the stream rows only: the rows after the first n_main of a pass.
It starts as the identity (`up` zero). `build_model` gives a config with stream_adapter_rank > 0
one of the classes below, which add the adapters to the top Ns layers.
"""
import torch.nn as nn

from ..model import GPT
from .pruning import PruningGPT


class StreamAdapter(nn.Module):
    def __init__(self, d_in, d_out, rank):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.down.weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.up.weight)

    def forward(self, x, y, n_main):
        """y = linear(x), updated in place for the rows after the first n_main (the streams)."""
        if x.shape[1] > n_main:
            y[:, n_main:] += self.up(self.down(x[:, n_main:]))
        return y


class StreamAdapters:
    """Adds a StreamAdapter to c_attn and c_fc of every multi-stream attention layer."""

    def __init__(self, config):
        super().__init__(config)
        d, r = config.n_embd, config.stream_adapter_rank
        for block in self.transformer.h[self.first_msa_layer(config.n_streams):]:
            block.attn.stream_adapter = StreamAdapter(d, 3 * d, r)
            block.mlp.stream_adapter = StreamAdapter(d, 4 * d, r)


class LosslessGPT(StreamAdapters, GPT):
    pass


class LosslessPruningGPT(StreamAdapters, PruningGPT):
    pass
