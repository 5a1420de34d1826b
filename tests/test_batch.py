"""Batches: every row of a batched decode is that prompt decoded alone; sampling stays exact per
row; the per-row cache compaction; bad input."""
import pytest
import torch
from conftest import random_model
from test_generate import SAMPLING, _chi_square_ok, _exact_first_tokens

from ss_mini import serving
from ss_mini.baseline import ar_step, ar_window, generate_ar
from ss_mini.generate import generate_speculative
from ss_mini.kvcache import KVCache
from ss_mini.sampling import Sampler
from ss_mini.step import prefill, speculative_step
from ss_mini.extras import make_tree
from ss_mini.extras.kernels import LeanKVCache


def _prompts(seed, B, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 24, (1,), generator=gen)),),
                          generator=gen).tolist()
            for _ in range(B)]


@pytest.mark.parametrize("spec", ["1,1,1", "3,2,1", "2,2", "n8", "n16", "1,1+L4", "L4"])
@pytest.mark.parametrize("drafter", [dict(n_streams=3), dict(n_streams=0, n_medusa_heads=3)],
                         ids=["streams", "medusa"])
def test_every_row_of_a_batch_is_its_prompt_decoded_alone(spec, drafter):
    """B up to 8, prompts of 1 to 23 tokens, 70 new tokens (past block_size 32: rows slide their
    windows at different steps), an end-of-text that ends some rows early: both decoders, greedy,
    float64, token for token."""
    model = random_model(seed=7, std=0.4, **drafter)
    tree = make_tree(spec, 3)
    for seed, B in ((0, 2), (1, 5), (2, 8)):
        prompts = _prompts(seed, B)
        alone = [generate_ar(model, p, 70)[0] for p in prompts]
        eot = alone[0][len(alone[0]) // 2]  # a token some rows emit, so that they stop there
        alone_eot = [generate_ar(model, p, 70, eot=eot)[0] for p in prompts]
        for kw, want in ((dict(), alone), (dict(eot=eot), alone_eot)):
            ar, _ = generate_ar(model, prompts, 70, **kw)
            ss, stats = generate_speculative(model, prompts, 70, tree, **kw)
            assert ar == want and ss == want, (spec, seed, kw)
            # rows accepted different numbers of tokens in the same passes
            if not kw and drafter.get("n_streams"):
                assert len(set(stats.accepted)) > 1
        assert any(len(o) < 70 for o in alone_eot)  # some rows end at end-of-text


def test_a_batch_of_one_is_the_single_prompt_api():
    model = random_model(seed=3, std=0.4)
    tree = make_tree("2,1,1", 3)
    single, s1 = generate_speculative(model, [1, 2, 3], 40, tree)
    batch, s2 = generate_speculative(model, [[1, 2, 3]], 40, tree)
    assert batch == [single] and s1.passes == s2.passes and s1.accepted == s2.accepted


@pytest.mark.parametrize("spec, kw", [("3,2", SAMPLING[0]), ("n6", SAMPLING[1]),
                                      ("1,1", SAMPLING[2]), ("2,1+L3", SAMPLING[1])])
def test_sampling_is_lossless_in_every_row_of_a_batch(spec, kw):
    """Four rows of the same prompt, one generator for the batch: each row's first three tokens
    follow the exact distribution (by enumeration), row by row."""
    model = random_model(seed=1, std=0.5, vocab_size=4, n_streams=2, block_size=16)
    prompt, k, n = [1, 2], 3, 400
    probs = _exact_first_tokens(model, prompt, k, **kw)
    counts = [{} for _ in range(4)]
    for i in range(n):
        outs, _ = generate_speculative(model, [prompt] * 4, k, make_tree(spec, 2), seed=i, **kw)
        for row, out in zip(counts, outs):
            row[tuple(out)] = row.get(tuple(out), 0) + 1
    for row in counts:
        assert not [seq for seq in row if probs[seq] == 0]
        ok, stat, crit = _chi_square_ok(row, probs, n)
        assert ok, f"chi-square {stat:.1f} >= {crit:.1f}"


def test_compaction_keeps_each_rows_own_path():
    """KVCache.accept against a reference that keeps each row's cache on its own: rows of
    different lengths accept different paths of different lengths in one call."""
    model = random_model()
    cfg, gen = model.config, torch.Generator().manual_seed(0)
    cache = KVCache(cfg, 40, batch_size=3, dtype=torch.float64)
    for kv in cache.kv:
        kv.normal_(generator=gen)
    cache.advance(torch.tensor([5, 0, 17]))
    ref = [torch.stack(cache.kv)[:, b].clone() for b in range(3)]  # (n_layer, S, 2, H, hd) per row
    # padded past each row's accepted length
    path = torch.tensor([[0, 2, 5, 5], [0, 1, 3, 4], [0, 0, 0, 0]])
    accepted = torch.tensor([3, 4, 1])
    lengths = cache.length.tolist()
    cache.accept(path, accepted)
    for b in range(3):
        L, a = lengths[b], int(accepted[b])
        want = ref[b].clone()
        want[:, L:L + a] = ref[b][:, [L + int(u) for u in path[b, :a]]]
        torch.testing.assert_close(torch.stack(cache.kv)[:, b, :L + a], want[:, :L + a],
                                   rtol=0, atol=0)
    assert cache.length.tolist() == [8, 4, 18]


def _spy(step, sizes, lengths=None):
    """step, recording the batch size of every call (and the cache's lengths before it)."""
    def spy(model, cache, *args, **kw):
        sizes.append(len(cache.length))
        if lengths is not None:
            lengths.append(cache.length.tolist())
        return step(model, cache, *args, **kw)
    return spy


def test_rows_that_finish_ride_along():
    """A row that is done stays in the batch, its tokens dropped, until every row is done: the
    batch keeps its size (every step has the same shapes), in both decoders, and every output is
    still its prompt decoded alone."""
    model = random_model(seed=4, std=0.4)
    prompts = [[1], [2, 3], [4]]
    # the first row ends after 3 tokens, others later or never
    eot = generate_ar(model, prompts[0], 40)[0][3]
    ar = [generate_ar(model, p, 40, eot=eot)[0] for p in prompts]
    sizes_ss, sizes_ar = [], []
    outs, st_ss = generate_speculative(model, prompts, 40, make_tree("1,1", 3), eot=eot,
                                       step=_spy(speculative_step, sizes_ss))
    assert outs == ar and len(ar[0]) == 3 and max(map(len, ar)) > 3
    outs, st_ar = generate_ar(model, prompts, 40, eot=eot, step=_spy(ar_step, sizes_ar))
    assert outs == ar
    for sizes, st in ((sizes_ss, st_ss), (sizes_ar, st_ar)):
        # some steps ran after a row had finished (fewer rows emitted than the batch carried) ...
        assert len(st.accepted) < 3 * len(sizes)
        assert set(sizes) == {3}  # ... and still carried 3 rows


def test_finished_rows_riding_along_need_no_rebuild():
    """A finished row riding along fills its cache too, but its tokens are dropped: it moves back
    without a prefill pass. So a batch whose other row crosses block_size counts the prefill, the
    decode passes and the live row's rebuilds only, as that row decoded alone does."""
    model = random_model(seed=4, std=0.4)
    prompts, n = [[1, 6], [5]], 70  # 70 tokens: row 1 crosses block_size 32 twice
    eot = 8  # row 0 emits it as its 4th token, row 1 not at all in its 70 tokens
    alone = [generate_ar(model, p, n, eot=eot)[0] for p in prompts]
    assert len(alone[0]) == 3 and len(alone[1]) == n
    for spec in (None, "1,1", "3,2,1", "n8"):
        sizes, lengths = [], []
        if spec is None:
            solo_out, solo = generate_ar(model, prompts[1], n)
            outs, st = generate_ar(model, prompts, n, eot=eot, step=_spy(ar_step, sizes, lengths))
        else:
            tree = make_tree(spec, 3)
            solo_out, solo = generate_speculative(model, prompts[1], n, tree)
            outs, st = generate_speculative(model, prompts, n, tree, eot=eot,
                                            step=_spy(speculative_step, sizes, lengths))
            assert len(st.nodes) == len(sizes)
        assert outs == alone and solo_out == alone[1]
        decode = len(sizes)  # the batch's decode passes: as many as the live row's alone
        assert decode == (len(solo.nodes) if spec else len(solo.accepted))
        # the live row alone: prefill, decode passes, rebuilds
        live_rebuilds = solo.passes - 1 - decode
        assert live_rebuilds >= 1  # it crossed block_size
        finished_moved_back = sum(after[0] < before[0]
                                  for before, after in zip(lengths, lengths[1:]))
        assert finished_moved_back >= 1, spec  # the finished row filled its cache and slid too
        assert set(sizes) == {2} and st.passes == 1 + decode + live_rebuilds, (
            spec, st.passes, decode, live_rebuilds)


def test_bad_batches_are_one_line_errors(monkeypatch):
    model = random_model()
    tree = make_tree("1,1", 3)
    with pytest.raises(ValueError, match="prompt 1 of the batch"):
        generate_ar(model, [[1, 2], [], [3]], 5)
    with pytest.raises(ValueError, match="empty prompt"):
        generate_speculative(model, [], 5, tree)
    monkeypatch.setattr(serving, "_free_memory", lambda device: 1 << 20)  # 1 MiB free
    with pytest.raises(ValueError, match=r"a batch of 4000 rows needs .* GiB for its KV cache"):
        generate_speculative(model, [[1]] * 4000, 5, tree)
    # room for the KV cache but not for a big tree's masks over it
    big = make_tree("n64", 3).bind(model.config, "cpu", model.lm_head.weight.dtype)
    cfg, size = model.config, model.lm_head.weight.element_size()
    kv = 2 * big.max_len * cfg.n_layer * 2 * cfg.n_embd * size
    monkeypatch.setattr(serving, "_free_memory", lambda device: kv + 1)
    generate_speculative(model, [[1], [2]], 5, make_tree("1", 3))
    with pytest.raises(ValueError, match=r"a batch of 2 rows needs .* GiB for its KV cache and "
                                         "masks"):
        generate_speculative(model, [[1], [2]], 5, big)
    with pytest.raises(ValueError, match=r"prompts of shape \(1, 2, 1\)"):
        generate_ar(model, torch.tensor([[[1], [2]]]), 5)
    with pytest.raises(ValueError, match=r"prompts of shape \(1, 2, 1\)"):
        generate_speculative(model, torch.tensor([[[1], [2]]]), 5, tree)
    with pytest.raises(ValueError, match="temperature"):
        generate_speculative(model, [[1], [2]], 5, tree, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        generate_ar(model, [[1], [2]], 5, temperature=-1.0)
    from ss_mini.extras.pruning import pruned_step
    pruning = random_model(prune_adapter_rank=4)
    with pytest.raises(ValueError, match="one prompt"):  # parallel tree pruning decodes one prompt
        generate_speculative(pruning, [[1], [2]], 5, tree, step=pruned_step(pruning, 0.1))


def test_a_tensor_of_prompts_is_a_batch():
    """A 2-D tensor is a batch (as its rows as lists), a 1-D tensor one prompt (as a list)."""
    model = random_model(seed=3, std=0.4)
    tree = make_tree("2,1", 3)
    rows = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for decode in (lambda p, **kw: generate_ar(model, p, 40, **kw),
                   lambda p, **kw: generate_speculative(model, p, 40, tree, **kw)):
        want, st = decode(rows)
        got, st2 = decode(torch.tensor(rows))
        assert got == want and len(got) == 3 and st2.passes == st.passes
        assert decode(torch.tensor(rows[1]))[0] == decode(rows[1])[0] == want[1]
        kw = dict(temperature=0.8, top_k=5, seed=1)
        assert decode(torch.tensor(rows), **kw)[0] == decode(rows, **kw)[0]


SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def _count_syncs(monkeypatch):
    """Count the calls that copy a tensor's values to the host (a host synchronisation on a GPU)."""
    calls = []
    for name in SYNCS:
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@pytest.mark.parametrize("spec", ["1,1,1", "3,2,1", "n8", "2,1+L3"])
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_k=5)], ids=["greedy", "sampling"])
def test_a_step_never_reads_the_device(monkeypatch, spec, kw):
    """speculative_step (draft, forward, verify, accept) and ar_step read nothing back to the host;
    the decoders read once per step: the tokens they emit."""
    model = random_model(seed=2, std=0.4)
    model.cache_class = KVCache  # LeanKVCache reads the lengths on a CPU (extras/kernels.py)
    tree = make_tree(spec, 3).bind(model.config, "cpu", torch.float64, batch_size=2)
    sampler = Sampler(kw.get("temperature", 0.0), kw.get("top_k"), None, 0, "cpu")
    cache, logits, drafts = prefill(model, [[1, 2, 3], [4, 5]], tree.draft_depth, tree.max_len)
    root = sampler.pick(logits)
    with torch.inference_mode():
        calls = _count_syncs(monkeypatch)
        lookup = tree.lookup([[1, 2, 3, 1], [4, 5, 4]]) if tree.lookup_length else None
        for _ in range(3):
            out = speculative_step(model, cache, root, drafts, tree, sampler, lookup=lookup)
            root, drafts = out.root, out.draft_logits
        ar_step(model, cache, root, sampler, ar_window(cache))
    assert calls == []
    out, stats = generate_speculative(model, [[1, 2, 3], [4, 5]], 20, tree, **kw)
    # prefill + one per step
    assert calls.count("tolist") == stats.passes and len(calls) == stats.passes


@pytest.mark.parametrize("spec", ["1,1,1", "n8"])
def test_continuous_batching_keeps_every_output(spec):
    """batch_size below the number of prompts: a prompt that finishes hands its row to the next
    one waiting; every output is still its prompt decoded alone (both decoders)."""
    model = random_model(seed=5, std=0.4)
    prompts = _prompts(3, 7)
    alone = [generate_ar(model, p, 50)[0] for p in prompts]
    eot = alone[2][len(alone[2]) // 3]
    want = [generate_ar(model, p, 50, eot=eot)[0] for p in prompts]
    for bs in (1, 2, 3):
        ar, s_ar = generate_ar(model, prompts, 50, eot=eot, batch_size=bs)
        ss, s_ss = generate_speculative(model, prompts, 50, make_tree(spec, 3), eot=eot,
                                        batch_size=bs)
        assert ar == want and ss == want, bs
    with pytest.raises(ValueError, match="batch_size=0"):
        generate_ar(model, prompts, 5, batch_size=0)


def test_the_full_batch_span_ends_when_a_row_has_no_prompt_to_take_its_place():
    """Stats.full_*: what the batch did at full strength (measure.py's tokens/s). Three prompts at
    two rows, no end-of-text: plain decoding's first two rows finish together and only one prompt
    waits, so the span is the first wave; one prompt alone: its whole decode."""
    model = random_model(seed=5, std=0.4)
    prompts, n = _prompts(4, 3), 9
    _, st = generate_ar(model, prompts, n, batch_size=2)
    assert (st.full_tokens, st.full_passes) == (2 * n, n)  # the prefill and n - 1 steps
    assert st.new_tokens == 3 * n and st.passes == 2 * n and 0 < st.full_seconds < st.seconds
    _, st = generate_speculative(model, prompts[0], 40, make_tree("2,1", 3))
    assert (st.full_tokens, st.full_passes) == (st.new_tokens, st.passes)
    _, st = generate_speculative(model, prompts, 40, make_tree("2,1", 3), batch_size=2)
    assert 0 < st.full_tokens < st.new_tokens and st.full_passes < st.passes



@pytest.mark.parametrize("spec", ["1,1,1", "3,2,1", "n8", "2,1+L3"])
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_k=5, seed=3)],
                         ids=["greedy", "sampling"])
def test_the_lean_cache_computes_what_the_plain_cache_does(monkeypatch, spec, kw):
    """LeanKVCache (extras/kernels.py: a slice written and only the slots in use read, in a CPU's
    eager steps) against KVCache: the same main logits at every pass (float64) and the same tokens,
    both decoders, past block_size, for one prompt (the lean path, which must have run: masks
    narrower than the cache) and for rows of different lengths (KVCache's path, but where the
    rows' lengths are equal: the prefill)."""
    model = random_model(seed=3, std=0.4, block_size=40)
    forward, seen = model.forward_nodes, {}

    def spy(idx, pos, mask, cache=None, **kw):
        out = forward(idx, pos, mask, cache=cache, **kw)
        seen[key].append((out[0], mask.shape[-1] < cache.max_len))
        return out
    monkeypatch.setattr(model, "forward_nodes", spy)
    for prompts in ([1, 2, 3], [[1, 2, 3], list(range(1, 11))]):
        for decoder in ("ar", "ss"):
            tokens = {}
            for cls in (KVCache, LeanKVCache):
                model.cache_class, key = cls, cls
                seen[key] = []
                if decoder == "ar":
                    tokens[cls] = generate_ar(model, prompts, 50, **kw)[0]
                else:
                    tokens[cls] = generate_speculative(model, prompts, 50, make_tree(spec, 3),
                                                       **kw)[0]
            assert tokens[LeanKVCache] == tokens[KVCache]
            plain, lean = seen[KVCache], seen[LeanKVCache]
            assert len(plain) == len(lean) and not any(narrow for _, narrow in plain)
            narrow = [n for _, n in lean]
            assert any(narrow) if isinstance(prompts[0], int) else not all(narrow)
            for (a, _), (b, _) in zip(plain, lean):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


# two rows, accepting 3 and 4 nodes; a path is padded with its last node, as accept gets it
@pytest.mark.parametrize("paths, moves", [([[0, 1, 2, 2], [0, 1, 2, 3]], False),
                                          ([[0, 1, 4, 4], [0, 1, 2, 3]], True),
                                          ([[0, 5, 6, 6], [0, 5, 6, 7]], True)])
def test_the_lean_cache_moves_nothing_for_a_path_in_place(monkeypatch, paths, moves):
    """An accepted path that is a prefix of the pass (a chain's, a lookup chain's: extras/
    lookup.py puts it first) is in place in the cache: LeanKVCache only advances the lengths.
    Another path moves as in KVCache. Either way both caches hold the same keys and values
    below the new lengths (past them, KVCache also copies the path's padding: never read)."""
    model = random_model(seed=0)
    caches = {}
    for cls in (KVCache, LeanKVCache):
        cache = cls(model.config, 24, 2, dtype=torch.float64)
        for i, kv in enumerate(cache.kv):
            kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(i)))
        cache.length[:] = 5
        cache.mask(ar_window(cache).expand(-1, -1, 8, -1))  # a pass of 8 rows: the lean path
        caches[cls] = cache
    moved, accept = [], KVCache.accept
    monkeypatch.setattr(KVCache, "accept", lambda self, *a: moved.append(1) or accept(self, *a))
    for cache in caches.values():
        cache.accept(torch.tensor(paths), torch.tensor([3, 4]))
    assert len(moved) == 1 + moves  # KVCache always, LeanKVCache when the path moves
    plain, lean = caches[KVCache], caches[LeanKVCache]
    assert torch.equal(plain.length, lean.length) and lean.length.tolist() == [8, 9]
    for a, b in zip(plain.kv, lean.kv):
        for row, length in enumerate(plain.length.tolist()):
            assert torch.equal(a[row, :length], b[row, :length])

@pytest.mark.parametrize("prompts", [[[1, 2, 3], list(range(1, 11)), [4]], [[1, 2, 3], [4, 5, 6]],
                                     [[5, 6, 7, 8]]])
def test_a_pass_sees_its_prefix_and_its_rows_only(monkeypatch, prompts):
    """Attention reads all of a cache's slots, so every step has the same shapes; the mask
    (KVCache.mask) shows row b its prefix, the slots below its length L[b], and hides every slot
    past the pass's R rows, L[b] + R on. Checked at every pass of both decoders (the prefill's
    included), for rows of different lengths, of one length and one row alone: the mask's prefix
    and tail, and the same outputs and logits (float64) when every slot from each row's length
    on holds garbage before the pass, as when it holds whatever earlier passes left there."""
    model = random_model(seed=6, std=0.4, block_size=96)
    model.cache_class = KVCache  # (LeanKVCache reads fewer slots: the next test)
    tree = make_tree("2,1", 3)
    forward, gen = model.forward_nodes, torch.Generator().manual_seed(0)
    logits, garbage = {}, False

    def spy(idx, pos, mask, cache=None, **kw):
        R, lengths = mask.shape[2], cache.length.tolist()
        assert mask.shape == (len(lengths), 1, R, cache.max_len)
        for b, L in enumerate(lengths):
            assert (mask[b, 0, :, :L] == 0).all()  # the prefix: seen by every row of the pass
            tail = mask[b, 0, :, L + R:]
            assert torch.isinf(tail).all() and (tail < 0).all()  # past the pass: hidden
            if garbage:
                for kv in cache.kv:
                    kv[b, L:] = torch.randn(kv[b, L:].shape, generator=gen, dtype=kv.dtype) * 1e3
        out = forward(idx, pos, mask, cache=cache, **kw)
        logits.setdefault((decoder, garbage), []).append(out[0])
        return out
    monkeypatch.setattr(model, "forward_nodes", spy)
    for decoder in ("ar", "ss"):
        outs = {}
        for garbage in (False, True):
            if decoder == "ar":
                outs[garbage] = generate_ar(model, prompts, 12)[0]
            else:
                outs[garbage] = generate_speculative(model, prompts, 12, tree)[0]
        assert outs[True] == outs[False]
        clean, dirty = logits[decoder, False], logits[decoder, True]
        assert len(clean) == len(dirty) > 1
        for a, b in zip(clean, dirty):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
