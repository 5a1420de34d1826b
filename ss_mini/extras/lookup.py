"""Drafts from the decoded text beside the streams' (prompt-lookup decoding, Saxena 2023), as
one more branch of the tree draft.

The tokens that followed the latest earlier occurrence of a row's last k tokens (the longest k
of 3, 2, 1 that occurs) cost no parameters and often continue the text: names, repeated lines,
quoted code. `LookupTree(ks, m)` is the streams' Cartesian tree `ks` plus a chain of m such
tokens under the root ('1,1,1+L4'; 'L4' alone is prompt-lookup decoding with this model, cache
and step). The pass, verify and accept treat its nodes like any other: a node is a node, but
one from the text carries no streams and, sampling, tries the text's next token first. Where
the text's draft is right, the path runs deep into the chain and the next pass mostly drafts
from the text again; the streams matter where it fails, near the root, and a stream row at
every chain node would cost every pass. A path that ends in the chain takes the root's drafts
for its next step: made for other positions, they are rarely accepted, and verify keeps the
output exact whatever they are. The chain comes first in the template, so a path along it is
already in place in the cache, and the CPU's eager cache then moves nothing (`LeanKVCache`,
extras/kernels.py).

Two rules keep it exact. The streams never propose the lookup's first token (`Sampler.draft`
takes it out of q_1 and ranks it last, for `draft_tree` in step.py), so the children of every
node hold distinct tokens, as in a tree of the streams alone: no node repeats another, and one
path is accepted. q_1 without that token is a distribution fixed by the decoded text before any
draw, so speculative sampling with it stays exact. Under sampling a lookup draft is a point
mass: the root and every node of the chain but the last try the lookup's next token first
(sampling.py), accepted with probability p(y), and on rejection p loses y before q's candidates
are tried.
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
        if self.ks and self.ks[0] >= config.vocab_size:  # the text's first token is not for them
            raise ValueError(f"tree {self} asks for {self.ks[0]} stream candidates at depth 1 "
                             f"besides the text's token; the vocabulary has {config.vocab_size}")
        return super().bind(config, device, dtype, batch_size)

    def paths(self, depth, width):
        """The root, the lookup chain (a path along it is a prefix of the pass, in place in the
        cache), then the streams' nodes."""
        streams = super().paths(depth, width)
        return streams[:1] + [(-1,) * j for j in range(1, self.chain + 1)] + streams[1:]

    def chains(self, contexts):
        """Each row's lookup chain, a list of `length` tokens, from its decoded tokens (the root
        last); -1s for a row whose last token never occurred before: never accepted (the pass
        runs them as token 0), and the streams then keep all of q_1."""
        return [lookup(c, self.chain) or [-1] * self.chain for c in contexts]

    def lookup(self, contexts):
        """The chains (B, length) on the device."""
        return torch.tensor(self.chains(contexts), device=self.template.depth.device)

    def look(self, lookup):
        """The token from the text that each node tries first when sampling (B, n), -1 for none:
        the root the chain's first, each node of the chain the next; the chain's last and the
        stream nodes none (no stream node holds the chain's first token: `Sampler.draft`)."""
        rest = lookup.new_full((lookup.shape[0], self.n_nodes - self.chain), -1)
        return torch.cat([lookup, rest], 1)

    def __repr__(self):
        streams = super().__repr__() + "+" if self.ks else ""
        return f"{streams}L{self.chain}"
