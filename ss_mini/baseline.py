"""The baseline: KV-cached autoregressive decoding, one token per row per forward pass, with
the same model, cache, sampler and rows of a batch as Speculative Streaming (generate.py), so
that a speedup measures the method and nothing else."""
import time

import torch

from .masks import attention_window
from .sampling import Sampler
from .serving import Batch, check_memory, prepare


def ar_window(cache):
    """The attention window of a one-token pass: a row sees its prefix and itself."""
    one = torch.ones(1, 1, 1, dtype=torch.bool, device=cache.slot.device)
    return attention_window(one, cache.max_len, cache.kv[0].dtype)


def ar_step(model, cache, root, sampler, window):
    """One autoregressive pass: cache each row's root (B,), return the token after it (B,)."""
    main_logits, _ = model.forward_nodes(root[:, None], cache.length[:, None], cache.mask(window),
                                         cache=cache, draft_depth=0)
    cache.advance(1)
    return sampler.pick(main_logits[:, 0])


@torch.inference_mode()
def generate_ar(model, prompts, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                seed=None, eot=None, on_tokens=None, batch_size=None, step=ar_step,
                clock=time.perf_counter):
    """KV-cached autoregressive decoding: one token per row per forward pass (the baseline).

    prompts, on_tokens, batch_size, clock and the result: as `generate_speculative`'s."""
    T, V = model.config.block_size, model.config.vocab_size
    prompts, single = prepare(model, prompts, max_new_tokens, batch_size)
    B = min(len(prompts), batch_size or len(prompts))
    check_memory(model, B, T, 1)
    sampler = Sampler(temperature, top_k, top_p, seed, model.lm_head.weight.device)
    batch = Batch(model, prompts, max_new_tokens, eot, on_tokens, 0, T, sampler, batch_size, clock)
    window = ar_window(batch.cache)
    while batch.going:
        sampler.draw_ahead(B, V)
        batch.roots = step(model, batch.cache, batch.roots, sampler, window)
        batch.emit([[t] for t in batch.roots.tolist()])  # the one host read per step
    return batch.finish(single)
