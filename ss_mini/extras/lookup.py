"""Drafts from the decoded text beside the streams' (prompt-lookup decoding, Saxena 2023), as
one more branch of the tree draft.

The tokens that followed the latest earlier occurrence of a row's last k tokens (the longest
k of 3, 2, 1 that occurs) cost no parameters and often continue the text: names, repeated
lines, quoted code. `LookupTree(ks, m)` is the streams' Cartesian tree `ks` plus a chain of m
such tokens under the root ('1,1,1+L4'; 'L4' alone is prompt-lookup decoding with this model,
cache and step). The pass, verify and accept treat its nodes like any other: a node is a node,
but one from the text carries no streams. Where the text's draft is right, the path runs deep
into the chain and the next pass mostly drafts from the text again; the streams matter where it
fails, near the root, and a stream row at every chain node would cost every pass. A path that
ends in the chain takes the root's drafts for its next step: made for other positions, they are
rarely accepted, and verify keeps the output exact whatever they are. The chain comes first in
the template, so a path along it is already in place in the cache (extras/kernels.py).

Two rules keep it exact. Where the lookup's first tokens equal a stream branch's (the same
tokens on the same path), those lookup nodes are *twins* of the stream nodes: the same token at
the same position under the same ancestors, so the same keys and values; a twin takes its
stream node's target, so a path of tokens is verified by one draw. Under sampling a lookup
draft is a point mass: the root, every stream node on the lookup's path and every lookup node
past the twins try the lookup's next token first (sampling.py), accepted with probability
p(y), and on rejection p loses y before q's candidates are tried. Whether a node tries it
depends only on the draws that made the nodes down to it, never on the draws of its
children, so the target at every node keeps plain sampling's distribution.
"""
import torch

from ..tree import CartesianTree

MAX_NGRAM = 3  # the longest suffix matched, as in Saxena's prompt-lookup decoding


def lookup(seq, length, max_ngram=MAX_NGRAM):
    """The `length` tokens that followed the latest earlier occurrence of seq's last k tokens,
    the longest k <= max_ngram that occurs; a continuation that reaches the end of seq goes on
    with its own tokens (a loop continues). None if seq's last token never occurred before."""
    text = "".join(map(chr, seq))  # one character per token: str.rfind searches in C
    for k in range(min(max_ngram, len(seq) - 1), 0, -1):
        start = text.rfind(text[-k:], 0, len(text) - 1)  # an occurrence ending before the last
        if start >= 0:
            loop = seq[start + k:]
            return (loop * (length // len(loop) + 1))[:length]
    return None


class LookupTree(CartesianTree):
    """The Cartesian tree ks of the streams (() for none) and a lookup chain of `length`."""

    def __init__(self, ks, length):
        if length < 1:
            raise ValueError(f"a lookup branch of {length} tokens: give at least 1, e.g. L4")
        if ks:
            super().__init__(ks)
        else:  # no stream nodes: the root and the chain
            self.ks, self.n_nodes, self.max_width, self.max_depth = (), 1, 1, 0
        self.lookup_length = self.chain = int(length)
        self.n_nodes += self.chain

    def bind(self, config, device, dtype, batch_size=1):
        super().bind(config, device, dtype, batch_size)
        t, m = self.template, self.chain
        if getattr(self, "_linked", None) is not t:  # once per template
            self._linked = t
            self.stream_nodes = (t.rank >= 0).nonzero().flatten()  # the root included
            self.stream_anc = t.anc[self.stream_nodes][:, self.stream_nodes]
            self.stream_depth = t.depth[self.stream_nodes]
            self.at_depth = self.stream_depth[:, None] == torch.arange(1, m + 1,
                                                                       device=t.depth.device)
        return self

    def paths(self, depth, width):
        """The root, the lookup chain (a path along it is a prefix of the pass: nothing moves in
        the cache, extras/kernels.py), then the streams' nodes."""
        streams = super().paths(depth, width)
        return streams[:1] + [(-1,) * j for j in range(1, self.chain + 1)] + streams[1:]

    def lookup(self, contexts):
        """Each row's lookup chain (B, length) on the device from its decoded tokens, the root
        last; a row with no earlier occurrence drafts token 0 (verified like any draft)."""
        chains = [lookup(c, self.chain) or [0] * self.chain for c in contexts]
        return torch.tensor(chains, device=self.template.depth.device)

    def link(self, tokens):
        """(twin, look) for a draft's tokens (B, n): the node whose target each node takes
        (itself; a stream node for its lookup twin) and the lookup token each node tries as a
        child first (-1: none): the root and the stream nodes on the lookup's path, and each
        lookup node past the twins."""
        B, m, stream = tokens.shape[0], self.chain, self.stream_nodes
        after = torch.cat([tokens[:, 1:m + 1], tokens.new_full((B, 1), -1)], 1)  # after depth d
        depth = self.stream_depth.expand(B, -1)
        same = tokens[:, stream] == after.gather(1, (depth - 1).clamp(0, m))
        same = (same | (depth == 0)) & (depth <= m)  # the root is on every path
        on_path = ~(self.stream_anc & ~same[:, None, :]).any(-1)  # (B, s)
        twin_at = on_path[:, :, None] & self.at_depth  # (B, s, m): stream twin of lookup node j
        has_twin = twin_at.any(1)
        own = torch.arange(tokens.shape[1], device=tokens.device).expand(B, -1)
        twin = torch.cat([own[:, :1], torch.where(has_twin, stream[twin_at.byte().argmax(1)],
                                                  own[:, 1:m + 1]), own[:, m + 1:]], 1)
        look = torch.where(on_path, after.gather(1, depth.clamp(max=m)), -1)  # stream nodes
        chain = torch.where(has_twin, -1, after[:, 1:])
        return twin, torch.cat([look[:, :1], chain, look[:, 1:]], 1)

    def __repr__(self):
        streams = super().__repr__() + "+" if self.ks else ""
        return f"{streams}L{self.chain}"
