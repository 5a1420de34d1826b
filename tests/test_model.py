"""The model: Eq. 1-3 and 5, the mask rule, the KV cache."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import random_model

from ss_mini.extras.distill import stream_teacher
from ss_mini.extras.kernels import PackedLinear, pack_linears
from ss_mini.kvcache import KVCache
from ss_mini.masks import attention_window, pass_mask, tree_mask
from ss_mini.io.checkpoint import param_counts
from ss_mini.model import GPT, GPTConfig


def reference_gpt2(model, idx):
    """GPT-2 written out independently (minGPT style) on the same weights: the main stream
    must be exactly this network."""
    sd, cfg = model.state_dict(), model.config
    H, C = cfg.n_head, cfg.n_embd
    B, T = idx.shape
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    ln = lambda x, p: F.layer_norm(x, (C,), sd[p + ".weight"], sd[p + ".bias"])
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        h = ln(x, p + "ln_1") @ sd[p + "attn.c_attn.weight"].T + sd[p + "attn.c_attn.bias"]
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in h.split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1),
                              float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ sd[p + "attn.c_proj.weight"].T + sd[p + "attn.c_proj.bias"]
        h = ln(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"].T + sd[p + "mlp.c_fc.bias"]
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ sd[p + "mlp.c_proj.weight"].T + sd[p + "mlp.c_proj.bias"]
    return ln(x, "transformer.ln_f") @ sd["transformer.wte.weight"].T


def reference_streams(model, idx):
    """Eq. 2-3 by brute force: for every (t, j), run the top layers on the sequence
    [main_0..main_t, S_t1..S_tj] with plain causal attention and read the last row."""
    cfg = model.config
    B, T = idx.shape
    h = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(T))
    first = cfg.n_layer - cfg.n_msa_layers
    for blk in model.transformer.h[:first]:
        h = blk(h, T, tree_mask(np.arange(T) - 1), None, 0)
    out = torch.zeros(B, T, cfg.n_streams, cfg.vocab_size, dtype=h.dtype)
    for t in range(T):
        for j in range(1, cfg.n_streams + 1):
            x = torch.cat([h[:, :t + 1], h[:, t:t + 1] + model.stream_emb[:j].unsqueeze(0)], dim=1)
            n = x.shape[1]
            for blk in model.transformer.h[first:]:
                x = blk(x, n, tree_mask(np.arange(n) - 1), None, 0)  # all rows as "main": causal
            out[:, t, j - 1] = model.lm_head(model.transformer.ln_f(x[:, -1]))
    return out


def test_main_stream_is_gpt2_and_ignores_streams():
    model = random_model(std=0.3)
    idx = torch.randint(0, 11, (2, 20))
    main, streams, _ = model(idx)
    torch.testing.assert_close(main, reference_gpt2(model, idx), rtol=0, atol=1e-10)
    plain = random_model(std=0.3, n_streams=0)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "stream_emb"})
    # equal up to rounding: with streams the main rows share one attention call with the stream
    # rows, whose masked keys change the summation order but add exactly zero
    torch.testing.assert_close(plain(idx)[0], main, rtol=0, atol=1e-12)
    with torch.no_grad():
        model.stream_emb.add_(torch.randn_like(model.stream_emb))
    main2, streams2, _ = model(idx)
    assert torch.equal(main, main2)
    assert not torch.allclose(streams, streams2)


def test_streams_follow_multi_stream_attention():
    model = random_model(std=0.3)
    idx = torch.randint(0, 11, (1, 9))
    _, streams, _ = model(idx)
    torch.testing.assert_close(streams, reference_streams(model, idx), rtol=0, atol=1e-10)


def test_stream_sees_only_what_the_mask_allows():
    model = random_model(std=0.3)
    idx = torch.randint(0, 11, (1, 12))
    _, base, _ = model(idx)
    t = 6
    later = idx.clone()
    # a future main position: no stream at <= t may change
    later[0, t + 1] = (later[0, t + 1] + 1) % 11
    _, s, _ = model(later)
    assert (torch.equal(s[0, :t + 1], base[0, :t + 1])
            and not torch.allclose(s[0, t + 1:], base[0, t + 1:]))
    earlier = idx.clone()
    earlier[0, t] = (earlier[0, t] + 1) % 11  # main position t: every stream at t sees it
    _, s, _ = model(earlier)
    assert torch.equal(s[0, :t], base[0, :t]) and not torch.allclose(s[0, t], base[0, t])
    # stream j sees streams i <= j at its position only: change P_2, stream 1 stays
    with torch.no_grad():
        # a constant would vanish in LayerNorm
        model.stream_emb[1] += torch.randn(16, dtype=torch.float64)
    _, s, _ = model(idx)
    assert torch.equal(s[..., 0, :], base[..., 0, :])
    assert (not torch.allclose(s[..., 1, :], base[..., 1, :])
            and not torch.allclose(s[..., 2, :], base[..., 2, :]))


def _with_prefix(m, L):
    """A pass's mask with the cached prefix (L columns, seen by every row) before its own keys."""
    return torch.cat([torch.ones(m.shape[0], L, dtype=torch.bool), m], dim=1)


def test_tree_mask_rule():
    m = _with_prefix(tree_mask([-1, 0, 0, 1, 3]), 2).int().tolist()
    assert m == [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0],
                 [1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1, 1]]
    assert torch.equal(tree_mask(np.arange(6) - 1), torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    # the stream rows of pass_mask; keys: 2 main, then streams (0,1) (0,2) (1,1) (1,2)
    s = pass_mask(tree_mask([-1, 0])[None], 2)[0, 2:].int().tolist()
    assert s == [[1, 0, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1]]
    with pytest.raises(ValueError):
        tree_mask([0, -1])


def test_loss_matches_hand_computation():
    model = random_model(std=0.3)
    idx = torch.randint(0, 11, (2, 7))
    tgt = torch.randint(0, 11, (2, 7))
    main, streams, losses = model(idx, tgt)
    lp_main = main.log_softmax(-1)
    ce_main = -sum(lp_main[b, t, tgt[b, t]] for b in range(2) for t in range(7)) / 14
    total = ce_main
    for j in range(1, 4):
        lp = streams[:, :, j - 1].log_softmax(-1)
        terms = [-lp[b, t, tgt[b, t + j]] for b in range(2) for t in range(7 - j)]
        ce = sum(terms) / len(terms)
        torch.testing.assert_close(losses["streams"][j - 1], ce)
        total = total + 0.1 * ce
    torch.testing.assert_close(losses["main"], ce_main)
    torch.testing.assert_close(losses["loss"], total)


def test_streams_distilled_from_the_main_stream():
    """stream_targets="main" (with teacher=stream_teacher): stream j at t learns the main stream's
    distribution at t+j (soft cross-entropy), the teacher gets no gradient from it, and 'streams'
    still reports the CE against the data. Without a teacher the loss is the data's (Eq. 5)."""
    model = random_model(std=0.3, stream_targets="main")
    idx, tgt = torch.randint(0, 11, (2, 7)), torch.randint(0, 11, (2, 7))
    main, streams, losses = model(idx, tgt, teacher=stream_teacher)
    data = random_model(std=0.3)(idx, tgt)[2]  # the same weights (same seed), trained on the data
    no_teacher = model(idx, tgt)[2]
    for key in ("loss", "main"):
        torch.testing.assert_close(no_teacher[key], data[key], rtol=0, atol=0)
    total = losses["main"]
    for j in range(1, 4):
        torch.testing.assert_close(losses["streams"][j - 1], data["streams"][j - 1])
        p = main[:, j:].softmax(-1)  # the main stream at t + j, for t + j < 7
        total = total + 0.1 * -(p * streams[:, :7 - j, j - 1].log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(losses["loss"], total)
    # the teacher is a constant: the gradient is that of the same loss with main.detach()
    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ours = grads(model(idx, tgt, teacher=stream_teacher)[2]["loss"])
    main, streams, _ = model(idx)
    hand = losses["main"].new_zeros(())
    for j in range(1, 4):
        hand = hand - 0.1 * (main[:, j:].detach().softmax(-1)
                             * streams[:, :7 - j, j - 1].log_softmax(-1)).sum(-1).mean()
    hand = grads(F.cross_entropy(main.reshape(-1, 11), tgt.reshape(-1)) + hand)
    for a, b in zip(ours, hand):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="stream_targets"):
        GPTConfig(stream_targets="labels")


@pytest.mark.parametrize("stride", [1, 3])
def test_streams_learn_the_main_streams_greedy_continuation(stride):
    """stream_targets="greedy": stream j at t learns the main stream's distribution at the
    j-th token of its own greedy continuation from t, as naive decoding computes it (the
    whole sequence re-run for every token); positions past the block are ignored."""
    model = random_model(std=0.3, stream_stride=stride, stream_targets="greedy")
    idx, tgt = torch.randint(0, 11, (2, 9)), torch.randint(0, 11, (2, 9))
    model.train()
    torch.manual_seed(5)
    offset = int(torch.randint(stride, ())) if stride > 1 else 0
    torch.manual_seed(5)
    main, streams, losses = model(idx, tgt, teacher=stream_teacher)
    where = list(range(offset, 9, stride))
    total = losses["main"]
    for j in range(1, 4):
        ce = []
        for i, t in enumerate(where):
            if t + j >= 9:
                continue
            seq = idx[:, :t + 1]
            for _ in range(j):  # greedy: append the main stream's argmax, re-run everything
                seq = torch.cat([seq, reference_gpt2(model, seq)[:, -1:].argmax(-1)], dim=1)
            # the main stream after j greedy tokens
            p = reference_gpt2(model, seq)[:, -1].softmax(-1)
            ce.append(-(p * streams[:, i, j - 1].log_softmax(-1)).sum(-1))
        total = total + 0.1 * torch.stack(ce, 1).mean()
    torch.testing.assert_close(losses["loss"], total)
    # and it is not what teacher forcing gives
    assert not torch.allclose(losses["loss"],
                              random_model(std=0.3, stream_stride=stride, stream_targets="main")
                              .train()(idx, tgt, teacher=stream_teacher)[2]["loss"])
    # no drafter: nothing to teach
    plain = random_model(std=0.3, n_streams=0, stream_targets="greedy")
    torch.testing.assert_close(plain(idx, tgt, teacher=stream_teacher)[2]["loss"],
                               F.cross_entropy(plain(idx)[0].reshape(-1, 11), tgt.reshape(-1)))


@pytest.mark.parametrize("targets", ["data", "main"])
def test_stream_stride_trains_the_same_streams_on_fewer_positions(targets):
    """stream_stride=k: in training mode the streams run at positions offset, offset + k, ...
    only. The main logits and the streams at those positions equal those of the full pass
    (a stream sees the main stream and its own lower streams, never another position's),
    and the loss is Eq. 5 restricted to them. In eval mode every position runs."""
    model = random_model(std=0.3, stream_stride=3, stream_targets=targets)
    idx, tgt = torch.randint(0, 11, (2, 10)), torch.randint(0, 11, (2, 10))
    full_main, full_streams, _ = model(idx, tgt)  # eval mode: all positions
    assert full_streams.shape[1] == 10
    model.train()
    torch.manual_seed(5)
    offset = int(torch.randint(3, ()))
    torch.manual_seed(5)
    main, streams, losses = model(idx, tgt, teacher=stream_teacher)
    where = list(range(offset, 10, 3))
    torch.testing.assert_close(main, full_main)
    torch.testing.assert_close(streams, full_streams[:, where])
    total = losses["main"]
    for j in range(1, 4):
        t = [i for i, w in enumerate(where) if w + j < 10]
        lp = streams[:, t, j - 1].log_softmax(-1)
        if targets == "data":
            y = tgt[:, [where[i] + j for i in t]]
            ce = -lp.gather(-1, y[..., None]).mean()
        else:
            ce = -(main[:, [where[i] + j for i in t]].softmax(-1) * lp).sum(-1).mean()
        total = total + 0.1 * ce
    torch.testing.assert_close(losses["loss"], total)
    with pytest.raises(ValueError, match="stream_stride"):
        GPTConfig(stream_stride=0)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("targets", ["data", "main", "greedy"])
def test_streams_without_a_target_add_nothing(stride, targets):
    """A sequence too short for stream j (T <= j + offset) trains the streams that have a
    target and adds 0 for the others: no error, no NaN."""
    for drafter in (dict(n_streams=3), dict(n_streams=0, n_medusa_heads=3)):
        model = random_model(std=0.3, stream_stride=stride, stream_targets=targets,
                             **drafter).train()
        for T in (1, 2, 3):
            idx = torch.randint(0, 11, (2, T))
            _, _, losses = model(idx, idx, teacher=stream_teacher)
            losses["loss"].backward()
            assert (torch.isfinite(losses["loss"])
                    and all(torch.isfinite(p.grad).all() for p in model.parameters()))
            # stream j >= T has no target
            assert [x.item() for x in losses["streams"][T - 1:]] == [0.0] * (4 - T)
            model.zero_grad()


@pytest.mark.parametrize("targets", ["data", "main", "greedy"])
def test_padded_targets_train_no_stream(targets):
    """Targets of -1 (ignore_index) are padding for the streams too: a batch padded at the end
    has the loss of the same batch cut before the padding, whatever the streams learn."""
    model = random_model(std=0.3, stream_targets=targets)
    idx, tgt = torch.randint(0, 11, (2, 9)), torch.randint(0, 11, (2, 9))
    padded = tgt.clone()
    padded[:, 6:] = -1
    torch.testing.assert_close(model(idx, padded, teacher=stream_teacher)[2]["loss"],
                               model(idx[:, :6], tgt[:, :6], teacher=stream_teacher)[2]["loss"])


def test_param_report():
    model = random_model(n_streams=4)
    base, draft = param_counts(model)
    assert draft == 4 * 16
    assert base + draft == sum(p.numel() for p in model.parameters())
    assert param_counts(random_model(n_streams=0)) == (base, 0)


SLOTS = 128  # the test caches' slots


def _pass_mask(cache, parents, n_streams):
    """A pass's mask over all the cache's slots: its nodes (parent pointers) see the cached prefix,
    their ancestors and themselves, and n_streams streams of every node (masks.py)."""
    anc = tree_mask(parents)[None]  # (1, n, n): u's ancestors and u itself
    window = attention_window(pass_mask(anc, n_streams), SLOTS, torch.float64)
    return cache.mask(window)


def _prefill(model, tokens):
    """A cache holding tokens, the main logits (1, n, V) and draft logits (1, n, g, V) of all of
    them."""
    cache = KVCache(model.config, SLOTS, dtype=torch.float64)
    n = len(tokens)
    mask = _pass_mask(cache, np.arange(n) - 1, model.config.n_streams)
    main, draft_logits = model.forward_nodes(torch.tensor([tokens]), torch.arange(n), mask,
                                             cache=cache)
    cache.advance(torch.tensor([n]))
    return cache, main, draft_logits


def _head_calls(model, run):
    """run()'s result and the rows of each LM head call it made."""
    rows = []
    hook = model.lm_head.register_forward_hook(
        lambda m, x, y: rows.append(x[0].numel() // x[0].shape[-1]))
    try:
        return run(), rows
    finally:
        hook.remove()


def eq2_reference(parents, n_streams, streams_of, L):
    """Paper Eq. 1-2 written out, one (query, key) pair at a time. Rows and keys: the main nodes,
    then stream (u, j) for u in streams_of and j = 1..n_streams; the keys start with the L cached
    prefix tokens. Main node u sees the prefix, its ancestors and itself, never a stream (Eq. 1);
    stream (u, j) sees what u sees and the streams (u, i), i <= j (Eq. 2)."""
    def ancestors_or_self(u):
        out = {u}
        while parents[u] >= 0:
            u = parents[u]
            out.add(u)
        return out

    rows = ([(None, u) for u in range(len(parents))]
            + [(j, u) for u in streams_of for j in range(1, n_streams + 1)])
    m = torch.zeros(len(rows), L + len(rows), dtype=torch.bool)
    for r, (j, u) in enumerate(rows):
        m[r, :L] = True  # the cached prefix
        for c, (i, v) in enumerate(rows):
            # a main key: u's ancestors and u itself, for u's main row and its streams alike
            if i is None:
                m[r, L + c] = v in ancestors_or_self(u)
            else:  # a stream key: only u's own streams i <= j, and only from a stream row
                m[r, L + c] = j is not None and v == u and i <= j
    return m


def test_pass_mask_is_eq2():
    """pass_mask (rows [main nodes; stream rows], keys the same, per batch row) against the rule
    written out (`eq2_reference`): random trees, streams on every node or on some, a prefix of L
    cached tokens in front; the main stream never sees a stream; the additive form that a pass
    reads over the cache's slots (attention_window) is the same mask, -inf past the pass."""
    gen = torch.Generator().manual_seed(0)
    for n, g, m in ((1, 1, None), (4, 2, None), (7, 3, None), (7, 3, 3), (9, 2, 1), (5, 3, 0)):
        B, L, S = 3, 3, 64
        parents = [[-1] + [int(torch.randint(0, u, (1,), generator=gen)) for u in range(1, n)]
                   for _ in range(B)]
        anc = torch.stack([tree_mask(p) for p in parents])
        idx = None if m is None else torch.stack(
            [torch.randperm(n, generator=gen)[:m].sort().values for _ in range(B)])
        local = pass_mask(anc, g, idx)
        R = n + (n if m is None else m) * g
        assert local.shape == (B, R, R)
        window = attention_window(local, S, torch.float32)
        for b in range(B):
            streams_of = list(range(n)) if idx is None else idx[b].tolist()
            want = eq2_reference(parents[b], g, streams_of, L)
            got = _with_prefix(local[b], L)
            assert torch.equal(got, want), (n, g, m, b)
            # main rows: tree_mask
            assert torch.equal(got[:n, :L + n], _with_prefix(tree_mask(parents[b]), L))
            assert not got[:n, L + n:].any()  # the main stream never sees a stream
            cut = window[b, 0, :, S - L:2 * S - L]  # a row holding L tokens (KVCache.mask)
            assert (torch.equal(cut[:, :L + R] == 0, want)
                    and torch.isinf(cut[:, :L + R][~want]).all())
            assert torch.isinf(cut[:, L + R:]).all() and (cut[:, L + R:] < 0).all()
    # without streams, or with none of the nodes carrying any: the tree's mask
    assert torch.equal(pass_mask(anc, 0), anc)
    assert torch.equal(pass_mask(anc, 2, torch.zeros(B, 0, dtype=torch.long)), anc)


def test_a_cache_refuses_autograd():
    """Decoding keeps no autograd history: a pass that would record one says what to do."""
    model = random_model(std=0.3)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        _prefill(model, [1, 2, 3])


@torch.no_grad()  # a KV cache is for decoding: it keeps no autograd history
def test_incremental_decoding_equals_full_forward():
    model = random_model(std=0.3)
    tokens = torch.randint(0, 11, (20,)).tolist()
    full_main, full_streams, _ = model(torch.tensor([tokens]))
    cache, main, streams = _prefill(model, tokens[:5])
    torch.testing.assert_close(main, full_main[:, :5], rtol=0, atol=1e-10)
    torch.testing.assert_close(streams, full_streams[:, :5], rtol=0, atol=1e-10)
    for t in range(5, 20):
        # one node: the prefix, itself, its streams
        mask = _pass_mask(cache, [-1], model.config.n_streams)
        # the main row's logits and its draft logits from one LM head call over all the pass's rows
        (m, d), heads = _head_calls(
            model, lambda: model.forward_nodes(torch.tensor([[tokens[t]]]), torch.tensor([t]),
                                               mask, cache=cache))
        assert heads == [1 + model.config.n_streams]
        cache.advance(torch.tensor([1]))
        torch.testing.assert_close(m[0, 0], full_main[0, t], rtol=0, atol=1e-10)
        torch.testing.assert_close(d[0, 0], full_streams[0, t], rtol=0, atol=1e-10)
    assert cache.length.tolist() == [20]


@torch.no_grad()
def test_a_pass_runs_the_first_streams_only():
    """draft_depth=g runs streams 1..g: they equal those of a pass with all gamma streams (stream j
    attends to streams <= j only, Eq. 2), and the main stream is unchanged."""
    model = random_model(std=0.3)
    cache, _, _ = _prefill(model, [1, 2, 3, 4, 5])
    parents, L, tokens = [-1, 0, 0, 1], cache.length, torch.tensor([[6, 7, 8, 9]])
    pos = torch.tensor([[0, 1, 1, 2]]) + L[:, None]
    main, drafts = model.forward_nodes(tokens, pos, _pass_mask(cache, parents, 3), cache=cache)
    assert drafts.shape == (1, 4, 3, 11)
    for g in (1, 2):
        m, d = model.forward_nodes(tokens, pos, _pass_mask(cache, parents, g), cache=cache,
                                   draft_depth=g)
        assert d.shape == (1, 4, g, 11)
        torch.testing.assert_close(m, main, rtol=0, atol=1e-10)
        torch.testing.assert_close(d, drafts[..., :g, :], rtol=0, atol=1e-10)


@torch.no_grad()
def test_tree_pass_equals_path_forward_and_compaction_equals_prefill():
    """Passes of 7 nodes (28 rows) and of 12 (48 rows): every node's logits are those of a plain
    forward over its path, whatever the pass's size, from one LM head call over all its rows."""
    model = random_model(std=0.3)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 11, (6,), generator=gen).tolist()
    cache, _, _ = _prefill(model, ctx)
    for n in (7, 12, 7, 12):  # several steps: each leaves the cache equal to a fresh prefill
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        tokens = torch.randint(0, 11, (n,), generator=gen).tolist()
        L = cache.length
        mask = _pass_mask(cache, parents, model.config.n_streams)
        (main, streams), heads = _head_calls(
            model, lambda: model.forward_nodes(torch.tensor([tokens]),
                                               torch.tensor([depths]) + L[:, None], mask,
                                               cache=cache))
        assert heads == [n * (1 + model.config.n_streams)]  # main and stream rows: one LM head call
        for u in range(n):  # every node: the logits of a plain forward over its root-to-node path
            path, v = [], u
            while v >= 0:
                path.append(v)
                v = parents[v]
            seq = ctx + [tokens[v] for v in reversed(path)]
            ref_main, ref_streams, _ = model(torch.tensor([seq]))
            torch.testing.assert_close(main[0, u], ref_main[0, -1], rtol=0, atol=1e-10)
            torch.testing.assert_close(streams[0, u], ref_streams[0, -1], rtol=0, atol=1e-10)
        leaf = max(range(n), key=lambda u: depths[u])
        path, v = [], leaf
        while v >= 0:
            path.append(v)
            v = parents[v]
        path = sorted(path)
        cache.accept(torch.tensor([path]), torch.tensor([len(path)]))
        ctx = ctx + [tokens[v] for v in path]
        fresh, _, _ = _prefill(model, ctx)
        assert cache.length.tolist() == fresh.length.tolist() == [len(ctx)]
        torch.testing.assert_close(torch.stack(cache.kv)[:, :, :len(ctx)],
                                   torch.stack(fresh.kv)[:, :, :len(ctx)], rtol=0, atol=1e-10)


def test_config_errors():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="n_msa_layers"):
        GPTConfig(n_layer=2, n_msa_layers=3)
    with pytest.raises(ValueError, match="block_size"):
        GPT(GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_msa_layers=1, n_embd=8,
                      n_head=2))(torch.zeros(1, 9, dtype=torch.long))
    # the extensions are subclasses, which build_model picks from the config; GPT itself refuses
    # them
    from ss_mini import build_model
    from ss_mini.extras.medusa import MedusaGPT
    from ss_mini.extras.pruning import PruningGPT
    from ss_mini.extras.lossless import LosslessGPT, LosslessPruningGPT
    small = dict(block_size=8, vocab_size=5, n_layer=2, n_msa_layers=1, n_embd=8, n_head=2)
    for extra, cls in ((dict(n_streams=0, n_medusa_heads=2), MedusaGPT),
                       (dict(prune_adapter_rank=2), PruningGPT),
                       (dict(stream_adapter_rank=2), LosslessGPT),
                       (dict(stream_adapter_rank=2, prune_adapter_rank=2), LosslessPruningGPT)):
        with pytest.raises(ValueError, match="build_model"):
            GPT(GPTConfig(**small, **extra))
        assert type(build_model(GPTConfig(**small, **extra))) is cls
    assert type(build_model(GPTConfig(**small))) is GPT


def test_medusa_heads_draft_from_the_last_hidden_state():
    model = random_model(std=0.3, n_streams=0, n_medusa_heads=2)
    assert param_counts(model)[1] == 2 * (16 * 16 + 16 + 16 * 11)  # K (d^2 + d + d V)
    idx = torch.randint(0, 11, (2, 9))
    main, drafts, losses = model(idx, idx)
    with torch.no_grad():
        h = model.transformer.h[0](
            model.transformer.wte(idx) + model.transformer.wpe(torch.arange(9)), 9,
            tree_mask(np.arange(9) - 1), None, 0)
        for blk in model.transformer.h[1:]:
            h = blk(h, 9, tree_mask(np.arange(9) - 1), None, 0)
        h = model.transformer.ln_f(h)
        for k, head in enumerate(model.medusa_heads):
            torch.testing.assert_close(drafts[:, :, k], head.lm_head(h + F.silu(head.res(h))))
    assert len(losses["streams"]) == 2
    # Medusa's init: identity block, a copy of the base head
    fresh = random_model(n_streams=0, n_medusa_heads=2)
    head = fresh.medusa_heads[0]
    assert torch.equal(head.lm_head.weight, fresh.lm_head.weight) and not head.res.weight.any()
    with pytest.raises(ValueError, match="choose one drafter"):
        GPTConfig(n_streams=2, n_medusa_heads=2)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_with_a_packed_weight_is_the_same_product(bias):
    """PackedLinear's packed weight (kernels.py) gives F.linear's values for every row count and
    batch shape, on either side of the thresholds, and is packed again when the weight
    changes."""
    torch.manual_seed(0)
    # 2^18 entries (packed when decoding) and a small weight
    for d_in, d_out in ((256, 1024), (64, 64)):
        layer = PackedLinear(d_in, d_out, bias=bias)
        for step in range(2):
            for shape in ((1, 1), (1, 2), (1, 4), (2, 3), (1, 64), (1, 65), (3, 40)):
                x = torch.randn(*shape, d_in)
                with torch.inference_mode():
                    y = layer(x)
                assert y.shape == (*shape, d_out) and y.is_contiguous()
                torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5,
                                           atol=1e-5)
            with torch.no_grad():
                layer.weight.mul_(-2.0)  # as an optimizer step would: the pack must follow


def test_linear_pack_needs_both_mkl_ops_and_is_freed_for_training_and_moves():
    """Packing runs only where torch has both MKL ops it calls; the packed copy of a big weight
    is freed when the model goes to training or to another device or dtype."""
    from types import SimpleNamespace
    from ss_mini.extras import kernels
    assert not kernels.mkl_packing(SimpleNamespace(_mkl_linear=None))  # the reorder op missing
    assert (kernels.mkl_packing(SimpleNamespace(_mkl_linear=None, _mkl_reorder_linear_weight=None))
            == kernels.MKL)
    if not kernels.MKL:
        pytest.skip("this torch has no MKL packing")
    model = torch.nn.Sequential(PackedLinear(256, 1024)).eval()
    for leave in (lambda: model.train(), lambda: model.to(torch.float64)):
        with torch.inference_mode():
            model(torch.randn(4, 256))
        assert model[0]._pack is not None
        leave()
        assert model[0]._pack is None
        model.float().eval()


def test_pack_linears_keeps_the_values():
    """pack_linears turns every nn.Linear (LM head, Medusa heads included) into PackedLinear in
    place, with the same weights and outputs; make_lean packs, build_model does not."""
    for drafter in (dict(n_streams=3), dict(n_streams=0, n_medusa_heads=2)):
        model = random_model(std=0.3, dtype=torch.float32, lean=True, **drafter)
        assert all(type(m) is PackedLinear
                   for m in model.modules() if isinstance(m, torch.nn.Linear))
        plain = random_model(std=0.3, dtype=torch.float32, **drafter)
        assert not any(type(m) is PackedLinear for m in plain.modules())
        plain = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 8)).eval()
        x = torch.randn(3, 256)
        with torch.inference_mode():
            want = plain(x)
            weight = plain[0].weight
            assert pack_linears(plain) is plain and plain[0].weight is weight
            assert [type(m) for m in plain] == [PackedLinear, PackedLinear]
            torch.testing.assert_close(plain(x), want, rtol=1e-5, atol=1e-5)
