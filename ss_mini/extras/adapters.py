"""Stream-only low-rank adapters: the lossless mode of the EMNLP version of the paper.

With the base model frozen (train.py --freeze_base=True), the only trainable parameters are
the stream embeddings P and, in the multi-stream attention layers, a low-rank update of the
shared linear layers that applies to the stream rows only. The main rows never pass through
it, so the main stream, and with it every verified token, stays exactly the base model's.
"""
import torch.nn as nn


class StreamAdapter(nn.Module):
    """linear(x) + up(down(x)) for the stream rows; `up` starts at zero, so the update does too."""

    def __init__(self, d_in, d_out, rank):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(self, x, y, n_main):
        """Add the update to y = linear(x) for the rows after the first n_main (the streams)."""
        if x.shape[1] > n_main:
            y[:, n_main:] += self.up(self.down(x[:, n_main:]))  # in place: the main rows are not copied
        return y


def stream_adapter(config, d_in, d_out, msa):
    """The adapter of one linear layer: only in multi-stream attention layers, only when asked for."""
    rank = config.stream_adapter_rank if msa and config.n_streams else 0
    return StreamAdapter(d_in, d_out, rank) if rank else None
