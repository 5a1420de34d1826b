"""The decoder of Speculative Streaming, `generate_speculative`: a short loop around one step
(step.py); the rows of a batch are serving.py's `Batch`, the baseline baseline.py's.

Greedy outputs are those of `generate_ar` token for token, up to float near-ties (a tree pass
multiplies other shapes than a one-token pass; the tests check equality in float64), and a row
of a batch decodes as it would alone. Sampled outputs follow plain sampling's distribution
exactly; rows of a batch share one generator, so they match a lone decode in distribution only.
A full row is rebuilt from its last block_size // 2 tokens (one prefill), in both decoders.
"""
import time

import torch

from .sampling import Sampler
from .serving import Batch, check_memory, prepare
from .step import speculative_step


@torch.inference_mode()
def generate_speculative(model, prompts, max_new_tokens, tree, temperature=0.0, top_k=None,
                         top_p=None, seed=None, eot=None, on_tokens=None, batch_size=None,
                         step=speculative_step, observe=None, clock=time.perf_counter):
    """Speculative Streaming: each forward pass verifies a tree draft and drafts the next one.

    prompts: a token list, or a list of token lists of any lengths (a batch). Returns the new
    tokens (a list, or a list per prompt) and Stats. on_tokens(prompt index, tokens) gets each
    pass's tokens as soon as they are final. batch_size: at most this many prompts decode at
    once, the next taking the place of one that finishes (None: all at once). tree: from
    `make_tree`.
    step: speculative_step, compiled or not, or one with another forward (extras/pruning.py).
    observe: called after each decode pass with what it did (step.py, lab/trace.py).
    clock: what Stats' seconds are read from (serving.py's `Batch`)."""
    cfg, w = model.config, model.lm_head.weight
    if cfg.n_drafts == 0:
        raise ValueError("this model has no speculative streams (n_streams=0): train one with "
                         "--n_streams=3, or decode without --speculative")
    prompts, single = prepare(model, prompts, max_new_tokens, batch_size)
    B = min(len(prompts), batch_size or len(prompts))
    tree.bind(cfg, w.device, w.dtype, B)
    check_memory(model, B, tree.max_len, tree.max_len - cfg.block_size)
    sampler = Sampler(temperature, top_k, top_p, seed, w.device)
    batch = Batch(model, prompts, max_new_tokens, eot, on_tokens, tree.draft_depth, tree.max_len,
                  sampler, batch_size, clock)
    while batch.going:
        sampler.draw_ahead(B, cfg.vocab_size, tree)
        chains = tree.chains(batch.contexts()) if tree.lookup_length else None
        out = step(model, batch.cache, batch.roots, batch.drafts, tree, sampler, observe=observe,
                   lookup=None if chains is None else torch.tensor(chains, device=w.device))
        batch.roots, batch.drafts = out.root, out.draft_logits
        emitted = torch.cat([out.n_emitted.unsqueeze(1), out.emitted], 1).tolist()  # one read
        batch.emit([row[1:1 + row[0]] for row in emitted], out.n_nodes, chains)
    return batch.finish(single)
