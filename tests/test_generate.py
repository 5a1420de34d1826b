"""The decoders: greedy identity, lossless sampling, edge cases."""
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import random_model

from ss_mini import ar_step, compile_step, speculative_step
from ss_mini.lab.shapes import host_shape
from ss_mini.io.checkpoint import load_model
from ss_mini.baseline import generate_ar
from ss_mini.generate import generate_speculative
from ss_mini.sampling import Sampler, target_probs
from ss_mini.model import GPT, GPTConfig
from ss_mini.kvcache import KVCache
from ss_mini.step import prefill
from ss_mini.extras import make_tree
from ss_mini.extras.budget_tree import BudgetTree
from ss_mini.extras.lookup import lookup
from ss_mini.tree import CartesianTree

TREES = (["1", "1,1,1", "4,1,1", "1,1,3", "5,3", "3,2,1", "2,2,2"]
         + [f"n{n}" for n in (1, 2, 3, 5, 8, 16, 33, 64)]
         + ["1,1,1+L4", "L4", "3,2+L3", "1+L6"])  # with drafts from the text (extras/lookup.py)


@pytest.mark.parametrize("spec", TREES)
@pytest.mark.parametrize("drafter", [dict(n_streams=3), dict(n_streams=0, n_medusa_heads=3)],
                         ids=["streams", "medusa"])
def test_greedy_identity_random_models(spec, drafter):
    for seed in range(3):
        # the method's classes, and (seed 0) the eager CPU kernels the scripts use
        model = random_model(seed=seed, std=0.4, lean=seed == 0, **drafter)
        tree = make_tree(spec, 3)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(4):
            prompt = torch.randint(0, 11, (int(torch.randint(1, 20, (1,), generator=gen)),),
                                   generator=gen).tolist()
            ar, _ = generate_ar(model, prompt, 70)  # 70 > block_size: crosses the sliding window
            ss, stats = generate_speculative(model, prompt, 70, tree)
            assert ss == ar, (spec, seed, prompt)
            # each decode pass emits its accepted drafts + 1; the prefill emitted the first token
            assert (stats.new_tokens == 70 and sum(stats.accepted) == 69
                    and len(stats.accepted) == len(stats.nodes))


def test_a_tree_is_bound_once_per_device():
    """sample.py binds the tree where the weights are and the decoder binds it again: the
    same device spelled two ways ("cuda" and cuda:0; here "cpu:0" and cpu) builds its shapes
    once."""
    cfg = random_model().config
    tree = make_tree("n8", 3).bind(cfg, "cpu:0", torch.float64)
    template = tree.template
    assert tree.bind(cfg, torch.device("cpu"), torch.float64).template is template


def test_a_shape_has_one_name_per_meaning():
    """The device shape's depths are a tensor, `depth`; the host view's are a list, `depths`:
    never both on one object."""
    tree = make_tree("2,1", 3).bind(random_model().config, "cpu", torch.float64)
    shape = tree.shape(torch.randn(1, 2, 11, dtype=torch.float64), depth_limit=torch.tensor([9]))
    host = host_shape(shape)
    assert torch.is_tensor(shape.depth) and not hasattr(shape, "depths")
    assert host.depths == [0, 1, 2, 1, 2] and not hasattr(host, "depth")  # depth-first


def test_a_loaded_model_decodes_through_the_method_unless_asked(tiny_ckpt):
    """load_model gives the method's own classes; lean=True (the scripts' --lean) the CPU's."""
    from ss_mini.extras.kernels import LeanKVCache, PackedLinear
    for lean, cache, linear in ((False, KVCache, torch.nn.Linear), (True, LeanKVCache,
                                                                    PackedLinear)):
        model = load_model(tiny_ckpt, lean=lean)[0]
        assert model.cache_class is cache and type(model.lm_head) is linear
    plain = GPT(model.config)  # as GPT(config) does
    assert plain.cache_class is KVCache and type(plain.lm_head) is torch.nn.Linear


def test_greedy_identity_trained_model(tiny_ckpt):
    model, tok, _ = load_model(tiny_ckpt, dtype=torch.float64)
    prompts = ["import os\n", "def f(x):\n    return",
               "class A:\n    def __init__(self):\n        self.", "#"]
    for spec in ("1,1,1", "3,2,1", "n8", "n32"):
        tree = make_tree(spec, model.config.n_streams)
        taus = []
        for p in prompts:
            ar, _ = generate_ar(model, tok.encode(p), 120)
            ss, stats = generate_speculative(model, tok.encode(p), 120, tree)
            assert ss == ar
            taus.append(stats.mean_accepted)
        assert sum(taus) / len(taus) > 1.2  # the trained streams do draft something


def test_compiled_decoders_match_eager():
    """--compile=True: the steps compiled whole (compile_step) give both decoders the outputs of
    the eager ones, across cache lengths, a chain and a budget tree, a sliding-window rebuild and
    a batch whose rows finish; sampling with one seed draws the same tokens."""
    model = random_model(seed=1, dtype=torch.float32, std=0.4, n_layer=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = set(vars(model))
    fast_ar, fast_ss = compile_step(ar_step), compile_step(speculative_step)
    for spec, prompt in (("1,1,1+L3", [1, 2, 3, 1, 2]), ("n5", [4] * 9)):
        tree = chain = make_tree(spec, 3)
        ar = generate_ar(model, prompt, 40)[0]
        assert generate_ar(model, prompt, 40, step=fast_ar)[0] == ar
        assert generate_speculative(model, prompt, 40, tree, step=fast_ss)[0] == ar
    prompts = [[1, 2, 3], [5], [4] * 9]
    eot = generate_ar(model, prompts[1], 40)[0][5]
    want = generate_ar(model, prompts, 40, eot=eot)[0]
    assert generate_speculative(model, prompts, 40, tree, eot=eot, step=fast_ss)[0] == want
    assert generate_ar(model, prompts, 40, eot=eot, step=fast_ar)[0] == want
    kw = dict(temperature=0.9, top_k=5, seed=3)
    for spec in ("n5", "1,1+L3"):
        tree = make_tree(spec, 3)
        assert (generate_speculative(model, [1, 2, 1], 20, tree, step=fast_ss, **kw)[0]
                == generate_speculative(model, [1, 2, 1], 20, tree, **kw)[0])
    # the eager model is untouched: no new attribute, the same weights, and it still decodes eagerly
    assert set(vars(model)) == attrs and all(torch.equal(v, state[k])
                                             for k, v in model.state_dict().items())
    assert generate_speculative(model, prompt, 40, tree)[0] == ar
    # its graph, compiled on other prompts, serves every step of a new one: nothing the host
    # changes per step (a length, a span) reaches it
    tree = chain
    with torch.compiler.set_stance("fail_on_recompile"):
        generate_ar(model, [7, 8], 60, step=fast_ar)
        generate_speculative(model, [7, 8], 60, tree, step=fast_ss)
    # a second model of the same shapes decodes with its own graphs, never the first one's (a CPU
    # graph skips dynamo's checks of the modules, but not of each weight's identity)
    model2 = random_model(seed=2, dtype=torch.float32, std=0.4, n_layer=2)
    ar2 = generate_ar(model2, [7, 8], 30)[0]
    assert ar2 != generate_ar(model, [7, 8], 30)[0]
    assert generate_ar(model2, [7, 8], 30, step=fast_ar)[0] == ar2
    assert generate_speculative(model2, [7, 8], 30, tree, step=fast_ss)[0] == ar2
    assert (generate_speculative(model, [7, 8], 30, tree, step=fast_ss)[0]
            == generate_ar(model, [7, 8], 30)[0])
    # weights changed in place after a graph froze them: refused, never decoded with the old ones
    with torch.no_grad():
        model.lm_head.weight.add_(0.5)
    for decode, step, kw in ((generate_ar, fast_ar, {}), (generate_speculative, fast_ss,
                                                           dict(tree=tree))):
        with pytest.raises(RuntimeError, match="weights changed since a compiled CPU step"):
            decode(model, [7, 8], 30, step=step, **kw)
        with pytest.raises(RuntimeError, match="weights changed"):  # another compile: the same
            decode(model, [7, 8], 30, step=compile_step(step.__wrapped__), **kw)


def _tensors(obj, seen=None, depth=0):
    """Every tensor reachable from obj through attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _tensors(item, seen, depth + 1)]


@pytest.mark.parametrize("spec", ["1,1,1", "3,2,1", "n8"])
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_k=5)], ids=["greedy", "sampling"])
def test_mark_static_marks_every_tensor_a_step_writes(spec, kw):
    """A CUDA graph replays a step's in-place writes at fixed addresses: inductor records one only
    when every tensor the step mutates is a static input. mark_static(cache) must mark each tensor
    that an eager speculative_step (or ar_step) writes in place, among everything reachable from the
    cache, the sampler, the tree and the step's inputs."""
    from ss_mini.extras.compile import mark_static
    from ss_mini.baseline import ar_window
    model = random_model(seed=2, std=0.4)
    model.cache_class = KVCache  # LeanKVCache reads the lengths on a CPU (extras/kernels.py)
    tree = make_tree(spec, 3).bind(model.config, "cpu", torch.float64, batch_size=2)
    sampler = Sampler(kw.get("temperature", 0.0), kw.get("top_k"), None, 0, "cpu")
    cache, logits, drafts = prefill(model, [[1, 2, 3], [4, 5]], tree.draft_depth, tree.max_len)
    root = sampler.pick(logits)
    mark_static(cache)
    with torch.no_grad():  # (not inference_mode: its tensors keep no version counter)
        for run in ("speculative", "ar"):
            sampler.draw_ahead(2, 11, tree if run == "speculative" else None)
            reachable = _tensors([cache, sampler, tree, root, drafts])
            before = [(t, t._version) for t in reachable]
            if run == "speculative":
                out = speculative_step(model, cache, root, drafts, tree, sampler)
                root, drafts = out.root, out.draft_logits
            else:
                root = ar_step(model, cache, root, sampler, ar_window(cache))
            written = [t for t, v in before if t._version != v]
            assert (any(t is cache.length for t in written)
                    and any(t is cache.kv[0] for t in written))
            unmarked = [tuple(t.shape) for t in written
                        if not hasattr(t, "_dynamo_static_input_type")]
            assert not unmarked, (
                f"{run} step writes tensors that mark_static leaves unmarked: {unmarked}")


def _cuda_graphs_recorded():
    """The CUDA graphs that inductor's CUDA-graph trees hold on device 0 (each a recording)."""
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_container(0).tree_manager
    nodes = list(manager.get_roots()) if manager is not None else []
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes += [c for children in node.children.values() for c in children]
    return count


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("spec", ["3,2,1", "n8", "1,1+L8", "L4"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prompts", [[[1, 2, 3, 1, 2]], [[1, 2, 3, 1, 2], [4, 5], [6, 7, 6]]])
def test_compiled_cuda_steps_replay_as_cuda_graphs(spec, temperature, dtype, prompts):
    """On CUDA a compiled step is recorded as a CUDA graph and replayed: graphs are recorded
    (a skipped or partitioned graph records none), one per shape however many decodes run, at
    cache addresses that never move, and a replay leaves the previous step's outputs as they
    were. fp32 greedy output is the eager one; bf16 and sampling match it at a rate (near-ties
    and the draws decide), asserted loosely and shown. Batches of 2 rows: a third prompt joins."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    model = random_model(seed=1, dtype=dtype, std=0.4, n_layer=2).cuda()
    tree = make_tree(spec, 3)
    kw = dict(temperature=temperature, seed=3, batch_size=2)
    steps, kept = [], []  # per step: the cache's addresses, and the last step's outputs

    def watched(step):
        def run(model, cache, *args, **kwargs):
            steps.append([t.data_ptr() for t in [*cache.kv, cache.length]])
            copies = [t.clone() for t in kept]  # as the decoder left them (a row may join)
            out = step(model, cache, *args, **kwargs)
            steps.append([t.data_ptr() for t in [*cache.kv, cache.length]])
            assert all(torch.equal(t, c) for t, c in zip(kept, copies)), \
                "a replay overwrote the outputs of the step before"
            kept[:] = [t for t in out if torch.is_tensor(t)]
            return out
        return run

    want = generate_speculative(model, prompts, 40, tree, **kw)[0]
    fast = compile_step(speculative_step)
    counters.clear()
    earlier = _cuda_graphs_recorded()  # other tests' graphs
    got = generate_speculative(model, prompts, 40, tree, step=watched(fast), **kw)[0]
    recorded = _cuda_graphs_recorded() - earlier
    again = generate_speculative(model, prompts, 40, tree, step=watched(fast), **kw)[0]
    inductor = dict(counters["inductor"])
    assert 0 < recorded <= 1, f"{recorded} CUDA graphs recorded for one shape: {inductor}"
    assert _cuda_graphs_recorded() - earlier == recorded, "a second decode recorded again"
    assert inductor.get("cudagraph_skips", 0) == 0 and not inductor.get("cudagraph_partitions")
    assert all(addresses == steps[0] for addresses in steps), "the cache moved"
    assert got == again
    match = sum(x == y for g, w in zip(got, want) for x, y in zip(g, w)) / sum(map(len, want))
    if dtype == torch.float32 and temperature == 0:
        assert got == want
    else:
        assert match >= 0.5, f"compiled {dtype} T={temperature} matched eager at {match:.2f}"


def _draft(tree, root, q, max_depth, vocab_size):
    """The tokens and shape (one row's, on the host) of a greedy tree draft, as speculative_step
    builds them: q (depths, V) the draft logits of one row."""
    cfg = GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=16, vocab_size=vocab_size,
                    n_streams=3, n_msa_layers=1)
    tree.bind(cfg, "cpu", torch.float32)
    shape = tree.shape(q[None], None, torch.tensor([max_depth]))
    ranked = torch.topk(q[None], tree.width, dim=-1).indices
    tokens = torch.cat([torch.tensor([[root]]), ranked.flatten(1).gather(1, shape.token_index)],
                       dim=1)
    return tokens[0].tolist(), host_shape(shape)


def test_budget_tree_is_best_first_and_holds_top1_chain():
    q = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-6], [0.9, 0.05, 0.05, 1e-6],
                               [0.5, 0.3, 0.1, 0.1]]))
    tokens, shape = _draft(BudgetTree(6), 7, q, 3, 4)
    parents, depths, children = shape.parents, shape.depths, shape.children
    assert tokens[0] == 7 and parents[0] == -1 and shape.n_nodes == 6
    chain = [0]
    for d in range(3):
        chain.append(next(c for c in children[chain[-1]] if tokens[c] == [0, 0, 0][d]))
    assert [depths[c] for c in chain] == [0, 1, 2, 3]
    assert chain == [0, 1, 2, 3]  # depth-first templates: the chain first, a prefix of the pass
    # best-first after the forced chain (.5, .45, .225): the next best paths are .3 and .3*.9
    scores = []
    for u in range(1, 6):
        s, v = 1.0, u
        while v > 0:
            s *= q[depths[v] - 1].exp()[tokens[v]].item()
            v = parents[v]
        scores.append(round(s, 4))
    assert sorted(scores, reverse=True) == [0.5, 0.45, 0.3, 0.27, 0.225]
    assert all(parents[i] < i for i in range(1, 6))
    # children hold ranks 0..m-1
    assert all(shape.ranks[c] == r for ch in children for r, c in enumerate(ch))
    # depth cut at 1 (4 tokens in the vocabulary): a budget tree always holds n nodes, and the
    # nodes a row may accept are chosen first: the root and every candidate of depth 1; the
    # others are deeper
    tokens, cut = _draft(BudgetTree(9), 1, q, 1, 4)
    assert cut.n_nodes == 9 and all(cut.parents[i] < i for i in range(1, 9))
    assert sorted(d for d in cut.depths if d <= 1) == [0, 1, 1, 1, 1]
    assert sorted(tokens[u] for u in range(9) if cut.depths[u] == 1) == [0, 1, 2, 3]


def test_cartesian_tree_shape():
    t = CartesianTree((3, 2, 1))
    assert len(t) == 1 + 3 + 6 + 6
    q = torch.randn(3, 11)
    tokens, shape = _draft(t, 5, q, 3, 11)
    # depth-first: the top-1 chain first (a path along it is a prefix), each subtree after its node
    assert shape.depths[:4] == [0, 1, 2, 3] and shape.ranks[:4] == [0, 0, 0, 0]
    assert sorted(shape.depths) == [0] + [1] * 3 + [2] * 6 + [3] * 6
    assert all(shape.parents[i] < i for i in range(1, len(t)))
    assert [len(shape.children[u]) for u in range(len(t))] == [3] + [2, 1, 0, 1, 0] * 3
    assert all([shape.ranks[c] for c in shape.children[u]] == list(range(len(shape.children[u])))
               for u in range(len(t)))
    top = torch.topk(q, 3).indices
    assert tokens[0] == 5
    assert all(tokens[u] == top[shape.depths[u] - 1, shape.ranks[u]] for u in range(1, len(t)))
    # max_depth 2 does not cut the shape (it is fixed: nodes deeper are never accepted)
    tokens, shape = _draft(t, 5, q, 2, 11)
    assert shape.n_nodes == 16 and tokens[0] == 5
    with pytest.raises(ValueError):
        make_tree("1,1,1,1", 3)
    with pytest.raises(ValueError):
        make_tree("abc", 3)
    assert make_tree("chain", 4).ks == (1, 1, 1, 1) and make_tree("chain", 2).ks == (1, 1)


def test_a_tree_runs_as_many_streams_as_it_is_deep():
    """A pass runs the streams of the depths its tree drafts, no more (at least one)."""
    cfg = GPTConfig(n_layer=2, n_head=1, n_embd=4, block_size=16, vocab_size=11, n_streams=4,
                    n_msa_layers=1)
    drafts = {spec: make_tree(spec, 4).bind(cfg, "cpu", torch.float32).draft_depth
             for spec in ("2,1", "3,2,1", "chain", "n1", "n2", "n4", "n5", "n16")}
    assert drafts == {"2,1": 2, "3,2,1": 3, "chain": 4, "n1": 1, "n2": 1, "n4": 3, "n5": 4,
                      "n16": 4}
    tree = make_tree("2,1", 4).bind(cfg, "cpu", torch.float32)
    shape = tree.shape(torch.randn(1, 2, 11), depth_limit=torch.tensor([9]))
    assert shape.window.shape[2] == 5 * (1 + 2)  # 5 main rows, 2 streams each
    assert host_shape(shape).mask(3).shape == (5 * (1 + 2), 3 + 5 * (1 + 2))


def _exact_first_tokens(model, prompt, k, **kw):
    """P(x_1..x_k | prompt) by enumeration with full forwards."""
    V = model.config.vocab_size
    probs = {}
    for seq in itertools.product(range(V), repeat=k):
        p = 1.0
        for i in range(k):
            logits, _, _ = model(torch.tensor([prompt + list(seq[:i])]))
            p *= target_probs(logits[0, -1], **kw)[seq[i]].item()
        probs[seq] = p
    return probs


def _chi_square_ok(counts, probs, n):
    """Pearson's test, categories with expected < 5 pooled; fails at p < 1e-3
    (Wilson-Hilferty approximation of the chi-square quantile)."""
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for seq, p in probs.items():
        e, o = p * n, counts.get(seq, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat, df = stat + (o - e) ** 2 / e, df + 1
    if pool_e > 0:
        stat, df = stat + (pool_o - pool_e) ** 2 / max(pool_e, 1e-9), df + 1
    z = 3.09  # one-sided 1e-3
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


SAMPLING = [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8)]


def _sample_counts(generate, n):
    counts, accepted = {}, []
    for i in range(n):
        out, stats = generate(i)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        accepted += stats.accepted
    return counts, accepted


STREAMS, MEDUSA = dict(n_streams=2), dict(n_streams=0, n_medusa_heads=3)


# a chain, several children per node, a budget tree, lookup branches (points masses whose nodes
# may repeat a stream branch); and more children than top_k leaves tokens:
# ranks 2 and 3 of "4,1" hold tokens that q never draws, tried after q's support is used up.
# Medusa's 3 heads with trees less deep than 3: a pass drafts only the depths its tree uses
@pytest.mark.parametrize("spec, kw, drafter",
                         [(spec, kw, STREAMS) for spec in ("1,1", "3,2", "n6") for kw in SAMPLING]
                         + [("4,1", dict(temperature=0.9, top_k=2), STREAMS),
                            ("1,1", dict(temperature=0.8), MEDUSA), ("3,2", SAMPLING[1], MEDUSA)]
                         + [("1,1+L3", SAMPLING[0], STREAMS), ("L3", SAMPLING[1], STREAMS),
                            ("3,2+L2", SAMPLING[2], STREAMS), ("2,1+L3", SAMPLING[1], MEDUSA)],
                         ids=lambda v: (("medusa" if v.get("n_medusa_heads") else "streams")
                                        if "n_streams" in v
                                        else "-".join(f"{k}{x}" for k, x in v.items())
                                        if isinstance(v, dict) else str(v)))
def test_speculative_sampling_is_lossless(spec, kw, drafter):
    """The first tokens follow the exact distribution (by enumeration) for every tree, sampling
    setting and drafter, drafts are accepted and rejected, and impossible tokens never appear."""
    model = random_model(seed=1, std=0.5, vocab_size=4, block_size=16, **drafter)
    prompt, k, n = [1, 2], 3, 1000
    probs = _exact_first_tokens(model, prompt, k, **kw)
    tree = make_tree(spec, model.config.n_drafts)
    counts, accepted = _sample_counts(
        lambda i: generate_speculative(model, prompt, k, tree, seed=i, **kw), n)
    assert not [seq for seq in counts if probs[seq] == 0], "a token of probability 0 was emitted"
    ok, stat, crit = _chi_square_ok(counts, probs, n)
    assert ok, f"chi-square {stat:.1f} >= {crit:.1f}"
    # both paths ran: drafts were accepted, and some pass stopped before the tree's depth (all
    # children rejected)
    assert max(accepted) > 1 and min(accepted) < 3


def test_medusa_sampling_with_a_tree_less_deep_than_its_heads():
    """Medusa with 3 heads, a tree 2 deep, sampling: a pass drafts the 2 depths the tree uses (the
    draws are made for 2), and the decoders give the tokens asked for, alone and in a batch, across
    the sliding window."""
    model = random_model(seed=2, std=0.4, n_streams=0, n_medusa_heads=3)
    tree = make_tree("1,1", 3)
    for prompt, n in (([1, 2, 3], 10), ([[1, 2, 3], [4]], 70)):
        out, stats = generate_speculative(model, prompt, n, tree, temperature=0.8, seed=0)
        outs = [out] if isinstance(prompt[0], int) else out
        assert ([len(o) for o in outs] == [n] * len(outs)
                and all(0 <= t < 11 for o in outs for t in o))
        assert stats.new_tokens == n * len(outs) and max(stats.accepted) <= 3
        again, _ = generate_speculative(model, prompt, n, tree, temperature=0.8, seed=0)
        assert again == out  # one seed, one output


def _nodes_of_8_targets(gen, n, V):
    """n nodes over 8 targets, node u of target u % 8: (the targets' logits (8, V), each node's
    target logits (n, V), each node's q logits: its target's plus noise, from none to much)."""
    base = torch.randn(8, V, generator=gen) * 1.5
    logits = base.repeat(n // 8, 1)
    q_logits = logits + torch.randn(n, V, generator=gen) * torch.linspace(0, 3, n)[:, None]
    return base, logits, q_logits


def _assert_each_target_followed(ys, p):
    """The tokens ys (n,) emitted by the nodes of each target i (u % 8 == i) follow p[i]: no
    token of probability 0, and a chi-square test."""
    V, n = p.shape[1], len(ys)
    for i in range(8):
        got = torch.bincount(ys[i::8], minlength=V).tolist()
        assert not [t for t in range(V) if p[i, t] == 0 and got[t]], (
            "a token of probability 0 was emitted")
        ok, stat, crit = _chi_square_ok({t: c for t, c in enumerate(got)},
                                        dict(enumerate(p[i].tolist())), n // 8)
        assert ok, f"target {i}: chi-square {stat:.1f} >= {crit:.1f}"


@pytest.mark.parametrize("children", [1, 2, 3, 5])
@pytest.mark.parametrize("kw", SAMPLING + [dict(temperature=0.9, top_k=2)],
                         ids=["T1", "top_k", "top_p", "top_k2"])
def test_verify_emits_the_target_distribution(children, kw):
    """The rule alone, with the power of many samples: 50,000 independent nodes, each with its
    own draft distribution q and `children` candidates drawn from it without replacement,
    some close to p and some far from it. The emitted tokens follow p exactly, and drafts are
    both accepted and rejected."""
    V, n = 6, 50_000
    gen = torch.Generator().manual_seed(0)
    base, logits, q_logits = _nodes_of_8_targets(gen, n, V)
    sampler = Sampler(kw["temperature"], kw.get("top_k"), kw.get("top_p"), 0, "cpu")
    ranked, q = sampler.draft(q_logits, children)
    shape = SimpleNamespace(q_row=torch.arange(n), has_child=torch.ones(n, children),
                            max_children=children)
    ys = sampler.verify(logits, q, ranked, shape)
    _assert_each_target_followed(ys, target_probs(base, **kw))
    # candidates past q's support (top_k < children) were never drawn
    drawn = q.gather(1, ranked) > 0
    # a rejected draft keeps no residual mass
    accepted = ((ranked == ys[:, None]) & drawn).any(1).sum().item()
    assert 100 < accepted < n - 100, f"{accepted} of {n} nodes accepted a draft"


@pytest.mark.parametrize("kw", SAMPLING, ids=["T1", "top_k", "top_p"])
def test_ar_sampling_is_exact(kw):
    model = random_model(seed=1, std=0.5, vocab_size=4, n_streams=2, block_size=16)
    probs = _exact_first_tokens(model, [1, 2], 3, **kw)
    counts, _ = _sample_counts(lambda i: generate_ar(model, [1, 2], 3, seed=i, **kw), 1000)
    assert not [seq for seq in counts if probs[seq] == 0] and _chi_square_ok(counts, probs, 1000)[0]


def _rig_drafts(monkeypatch, model, rig):
    """The drafter's logits replaced by rig(logits) wherever a pass computes them: the second
    output of GPT.forward_top (the prefill's, every tree pass's, a pruned pass's)."""
    top = model.forward_top

    def forward_top(*args, **kwargs):
        main_logits, draft_logits = top(*args, **kwargs)
        return main_logits, draft_logits if draft_logits is None else rig(draft_logits)

    monkeypatch.setattr(model, "forward_top", forward_top)


def _constant(V=5, logits=(2.0, 1.5, 1.0, 0.5, 0.0)):
    """A model whose every row, main or stream, gives the same logits whatever the context."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=64, vocab_size=V, n_streams=3,
                          n_msa_layers=1))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()  # ln_f(x) = its bias, for every row
        model.transformer.ln_f.bias.copy_(torch.eye(8)[0])
        model.transformer.wte.weight.zero_()
        model.transformer.wte.weight[:, 0] = torch.tensor(logits)
    return model.double().eval()


def test_drafts_from_the_target_itself_are_always_accepted():
    """q = p exactly: every draft is accepted, at any temperature."""
    model = _constant()
    for kw in SAMPLING:
        out, stats = generate_speculative(model, [0, 1], 40, make_tree("2,2,2", 3), seed=0, **kw)
        # root + 3 drafts every pass
        assert len(out) == 40 and set(stats.accepted[:-1]) == {4}, stats.accepted


def test_drafts_outside_the_target_support_are_always_rejected(monkeypatch):
    """q and p with disjoint supports: every draft is rejected and the output is still p."""
    model = _constant(logits=(2.0, 1.5, -1.0, -1.0, -1.0))
    kw = dict(temperature=1.0, top_k=2)  # p lives on tokens 0 and 1
    _rig_drafts(monkeypatch, model, lambda q: torch.full_like(q, -30.0).index_fill_(
        -1, torch.tensor([2, 3]), 5.0))  # q lives on tokens 2 and 3 (after top_k=2 as well)
    probs = {seq: 1.0 for seq in itertools.product(range(5), repeat=2)}
    p = target_probs(torch.tensor([2.0, 1.5, -1.0, -1.0, -1.0], dtype=torch.float64), **kw)
    probs = {seq: p[seq[0]].item() * p[seq[1]].item() for seq in probs}
    counts, accepted = _sample_counts(
        lambda i: generate_speculative(model, [0, 1], 2, make_tree("2,2", 3), seed=i, **kw), 600)
    assert set(accepted) == {1}
    assert _chi_square_ok(counts, probs, 600)[0]


def test_target_probs_top_k_top_p():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    torch.testing.assert_close(target_probs(logits, 1.0, top_k=2),
                               torch.tensor([0, 4 / 7, 0, 3 / 7]))
    torch.testing.assert_close(target_probs(logits, 1.0, top_p=0.6),
                               torch.tensor([0, 4 / 7, 0, 3 / 7]))
    torch.testing.assert_close(target_probs(logits, 1.0, top_p=0.75),
                               torch.tensor([0, 4 / 9, 2 / 9, 3 / 9]))
    torch.testing.assert_close(target_probs(logits, 1.0, top_p=0.01),
                               torch.tensor([0.0, 1.0, 0.0, 0.0]))


def _rigged(V=5, c=3):
    """A model that always predicts token c, from the main stream and from every stream."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=24, vocab_size=V, n_streams=3,
                          n_msa_layers=1))
    with torch.no_grad():
        for blk in model.transformer.h:  # blocks add nothing
            for lin in (blk.attn.c_proj, blk.mlp.c_proj):
                lin.weight.zero_(), lin.bias.zero_()
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(torch.eye(8)[0] * 10)
        model.transformer.wte.weight.zero_()
        model.transformer.wte.weight[c, 0] = 1.0
    return model.double().eval()


def test_every_draft_accepted_and_every_draft_rejected(monkeypatch):
    model = _rigged()
    ar, _ = generate_ar(model, [0, 1], 40)
    assert ar == [3] * 40
    ss, stats = generate_speculative(model, [0, 1], 40, make_tree("1,1,1", 3))
    assert ss == ar and stats.accepted[:5] == [4] * 5  # root + 3 drafts every pass
    # streams now always propose token 4, which the model never emits
    _rig_drafts(monkeypatch, model,
                lambda q: torch.zeros_like(q).index_fill_(-1, torch.tensor([4]), 50.0))
    ss, stats = generate_speculative(model, [0, 1], 40, make_tree("2,2,2", 3))
    assert ss == ar and set(stats.accepted) == {1}


def test_edge_cases():
    model = random_model(seed=3, std=0.4)
    T = model.config.block_size
    tree = make_tree("2,1,1", 3)
    for prompt, n in (([5], 1), ([5], 30), ([1] * (T - 1), 20), ([2] * T, 20), ([4, 2], 1)):
        ar, sa = generate_ar(model, prompt, n)
        ss, sb = generate_speculative(model, prompt, n, tree)
        assert ss == ar and len(ss) == n
        assert sa.passes >= n  # one pass per token, plus a rebuild when the window slides
    with pytest.warns(UserWarning, match=f"keeping its last {T // 2}"):
        long_ar, _ = generate_ar(model, list(range(11)) * 5, 10)
    assert long_ar == generate_ar(model, (list(range(11)) * 5)[-(T // 2):], 10)[0]
    with pytest.raises(ValueError, match="empty prompt"):
        generate_ar(model, [], 5)
    with pytest.raises(ValueError, match="n_streams=0"):
        generate_speculative(random_model(n_streams=0), [1], 5, tree)
    for gen in (lambda: generate_ar(model, [1, 2], 5, temperature=-0.5),
                lambda: generate_speculative(model, [1, 2], 5, tree, temperature=-0.5)):
        with pytest.raises(ValueError, match="temperature=-0.5"):
            gen()


def test_tree_specs_with_a_lookup_branch():
    """'+LM' after a top-k tree (chain too) or 'LM' alone; anything else is a one-line error
    that names the whole spec."""
    assert ([repr(make_tree(s, 4)) for s in ("1,1+L4", "chain+L8", "L3")]
            == ["1,1+L4", "1,1,1,1+L8", "L3"])
    assert [len(make_tree(s, 4)) for s in ("1,1+L4", "3,2+L6", "L3")] == [7, 16, 4]
    for spec, message in (("n8+L2", "goes with a top-k tree"),
                          ("none+L2", "goes with a top-k tree"),
                          ("x+L2", r"--tree=x\+L2: give top-k"), ("1,1L4", "give top-k"),
                          ("1,1+L", "give top-k"), ("L0", "at least 1"),
                          ("1,1,1,1,1+L3", r"--tree=1,1,1,1,1\+L3: .*5 depths")):
        with pytest.raises(ValueError, match=message):
            make_tree(spec, 4)
    model = random_model(seed=0, n_streams=2, vocab_size=3)  # the text's token and two others
    make_tree("2+L2", 2).bind(model.config, "cpu", torch.float32)
    with pytest.raises(ValueError, match="3 stream candidates at depth 1 besides the text's"):
        make_tree("3+L2", 2).bind(model.config, "cpu", torch.float32)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prompt_lookup_decoding_runs_no_streams(temperature):
    """A tree without stream nodes ('L4': prompt-lookup decoding) uses no draft of the streams,
    so neither its prefill nor its passes run them; greedy, it still decodes as plain decoding."""
    model = random_model(seed=2, std=0.5)
    depths, forward = [], model.forward_nodes
    model.forward_nodes = lambda *a, **kw: depths.append(kw["draft_depth"]) or forward(*a, **kw)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    out, stats = generate_speculative(model, prompt, 40, make_tree("L4", 3),
                                      temperature=temperature, seed=0)
    assert set(depths) == {0} and len(depths) == stats.passes
    if not temperature:
        assert out == generate_ar(model, prompt, 40)[0]


@pytest.mark.parametrize("spec", ["2,1,1", "n8"])
def test_a_prompt_longer_than_block_size_is_one_prefill(spec):
    """A prompt longer than block_size keeps its last block_size // 2 tokens (with a warning), as
    the sliding window would: one prefill pass, no rebuild right after it (a prompt cut to
    block_size tokens would fill the cache at once), and greedy speculative decoding is greedy AR
    decoding."""
    model = random_model(seed=3, std=0.4)
    T = model.config.block_size
    prompt = torch.randint(0, 11, (T + 19,), generator=torch.Generator().manual_seed(0)).tolist()
    with pytest.warns(UserWarning, match="longer than block_size"):
        ar, sa = generate_ar(model, prompt, 6)
    with pytest.warns(UserWarning, match="longer than block_size"):
        ss, sb = generate_speculative(model, prompt, 6, make_tree(spec, 3))
    assert ss == ar == generate_ar(model, prompt[-(T // 2):], 6)[0]
    # the prefill, then one pass per token after the first
    assert sa.passes == 1 + len(sa.accepted) == 6
    assert sb.passes == 1 + len(sb.nodes) and len(sb.nodes) == len(sb.accepted)


def test_stops_at_end_of_text():
    model = _rigged(c=3)
    for gen in (lambda: generate_ar(model, [0], 20, eot=3),
                lambda: generate_speculative(model, [0], 20, make_tree("1,1,1", 3), eot=3)):
        out, stats = gen()
        assert out == [] and stats.new_tokens == 0
    model = random_model(seed=4, std=0.4)
    ar, _ = generate_ar(model, [1, 2, 3], 60)
    eot = ar[25]
    ar_eot, _ = generate_ar(model, [1, 2, 3], 60, eot=eot)
    ss_eot, _ = generate_speculative(model, [1, 2, 3], 60, make_tree("3,2,1", 3), eot=eot)
    assert ar_eot == ss_eot == ar[:ar.index(eot)]


@pytest.mark.parametrize("spec", ["3,2,1", "n16", "L4"])  # L4: a tree that runs no streams
def test_tree_pruning(spec):
    from ss_mini.extras.pruning import pruned_step
    model = random_model(seed=5, std=0.4, prune_adapter_rank=4)
    with torch.no_grad():
        model.prune_adapter.up.weight.normal_(0, 0.3)  # an untrained adapter would be the identity
    tree = make_tree(spec, 3)
    for seed in range(3):
        prompt = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        ar, _ = generate_ar(model, prompt, 50)
        plain, s0 = generate_speculative(model, prompt, 50, tree)
        # nothing is pruned
        zero, sz = generate_speculative(model, prompt, 50, tree, step=pruned_step(model, 1e-12))
        assert zero == plain == ar and sz.accepted == s0.accepted and sz.nodes == s0.nodes
        for thr in (0.05, 0.2, 0.5):  # greedy identity whatever is pruned
            out, st = generate_speculative(model, prompt, 50, tree, step=pruned_step(model, thr))
            assert out == ar
            assert sum(st.nodes) <= sum(s0.nodes)
        # only the root survives
        high, sh = generate_speculative(model, prompt, 50, tree, step=pruned_step(model, 1.01))
        assert high == ar and set(sh.nodes) == {1} and set(sh.accepted) == {1}
    with pytest.raises(ValueError, match="pruning adapter.*prune_adapter_rank"):
        pruned_step(random_model(), 0.1)
    with pytest.raises(ValueError, match="greedy only"):
        pruned_step(model, 0.1, temperature=0.8)
    with pytest.raises(ValueError, match="one prompt"):  # raised by the first step
        generate_speculative(model, [[1], [2]], 5, tree, step=pruned_step(model, 0.1))


def test_pruning_keeps_the_cache_consistent():
    """After a pruned pass the cache still equals a fresh prefill of the accepted text."""
    from ss_mini.extras.pruning import pruned_forward
    from ss_mini.step import Draft
    from ss_mini.tree import TreeShape
    model = random_model(seed=6, std=0.4, prune_adapter_rank=4)
    with torch.no_grad():
        model.prune_adapter.up.weight.normal_(0, 0.3)
    ctx = [1, 2, 3, 4]
    tree = BudgetTree(7).bind(model.config, "cpu", torch.float64)
    cache, _, _ = prefill(model, [ctx], tree.draft_depth, tree.max_len)
    # the tree parents [-1, 0, 0, 1, 1, 2, 3], ranks [0, 0, 1, 0, 1, 0, 0]: its nodes in the
    # template
    paths = tree.paths(tree.draft_depth, tree.width)
    sel = torch.tensor([[paths.index(p)
                         for p in [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]]])
    shape = TreeShape(tree.template, sel, tree.draft_depth, tree.max_len, tree.width)
    assert (host_shape(shape).parents == [-1, 0, 0, 1, 1, 2, 3]
            and host_shape(shape).ranks == [0, 0, 1, 0, 1, 0, 0])
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 0]])
    kept_draft, main, drafts = pruned_forward(model, cache, Draft(tokens, shape, None, None, None),
                                              tree, 0.09)
    tokens_k, shape_k = kept_draft.tokens, kept_draft.shape
    kept = host_shape(shape_k)
    assert 1 < kept.n_nodes < 7, kept.n_nodes  # this seed prunes some nodes, not all
    assert tokens_k.shape == (1, kept.n_nodes) and main.shape[1] == drafts.shape[1] == kept.n_nodes
    leaf = kept.n_nodes - 1
    path = [leaf]
    while kept.parents[path[-1]] >= 0:
        path.append(kept.parents[path[-1]])
    path = sorted(path)
    seq = ctx + tokens_k[0, path].tolist()
    ref, ref_streams, _ = model(torch.tensor([seq]))
    torch.testing.assert_close(main[0, leaf], ref[0, -1], rtol=0, atol=1e-10)
    # the next drafts too
    torch.testing.assert_close(drafts[0, leaf], ref_streams[0, -1], rtol=0, atol=1e-10)
    cache.accept(torch.tensor([path]), torch.tensor([len(path)]))
    fresh, _, _ = prefill(model, [seq], tree.draft_depth, tree.max_len)
    assert cache.length.tolist() == fresh.length.tolist() == [len(seq)]
    torch.testing.assert_close(torch.stack(cache.kv)[:, :, :len(seq)],
                               torch.stack(fresh.kv)[:, :, :len(seq)], rtol=0, atol=1e-10)


@pytest.mark.parametrize("drafter", ["streams", "medusa"])
def test_products_are_those_of_a_tree_pass(drafter):
    """measure.products runs the Linear layers of a decoding step on the rows it carries, in its
    order: those of a speculative step over an n-node tree (n main rows below the multi-stream
    layers, n (1 + g) in them, then the LM head once over all rows, whatever the pass's size;
    Medusa's heads on the main rows) and of an autoregressive step."""
    from ss_mini.baseline import ar_window
    from ss_mini.lab.measure import products
    kw = (dict(n_streams=3, n_msa_layers=2) if drafter == "streams"
          else dict(n_streams=0, n_medusa_heads=2))
    model = random_model(**kw).float()
    seen = []
    hooks = [m.register_forward_hook(lambda m, x, y, name=name:
                                     seen.append((name, x[0].numel() // x[0].shape[-1])))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    sampler, root = Sampler(0.0, None, None, None, "cpu"), torch.tensor([1])
    with torch.no_grad():
        for n in (1, 4, 16):
            tree = BudgetTree(n).bind(model.config, "cpu", torch.float32)
            cache, _, draft_logits = prefill(model, [[1, 2, 3]], tree.draft_depth, tree.max_len)
            seen.clear()
            speculative_step(model, cache, root, draft_logits, tree, sampler)
            step, seen[:] = list(seen), []
            products(model, n, tree.draft_depth)()
            assert seen == step, n
            # one LM head call per pass, over the main rows and every stream row (64 rows for
            # n = 16)
            heads = [rows for name, rows in step if name == "lm_head"]
            assert heads == [n * (1 + model.streams_in_pass(tree.draft_depth))], (n, heads)
        cache, _, _ = prefill(model, [[1, 2, 3]], 0, model.config.block_size)
        seen.clear()
        ar_step(model, cache, root, sampler, ar_window(cache))
        step, seen[:] = list(seen), []
        products(model, 1, draft_depth=0)()
        assert seen == step and {rows for _, rows in step} == {1}
    for h in hooks:
        h.remove()


def test_repeat_rate():
    """The share of n-grams that occurred earlier in the same output (per output, not across)."""
    from ss_mini.lab.measure import repeat_rate
    # 123 231 312 new, then 4 repeats
    assert repeat_rate([[1, 2, 3, 1, 2, 3, 1, 2, 3]], n=3) == 4 / 7
    # the same text in two outputs
    assert repeat_rate([list(range(20)), list(range(20))], n=3) == 0.0
    assert repeat_rate([[7] * 5], n=2) == 3 / 4
    assert repeat_rate([[1, 2]], n=3) == 0.0  # shorter than n: nothing to count


def test_compiled_steps_stop_with_one_line_past_their_limit(monkeypatch):
    """One graph per model, tree, batch size and sampling mode; past MAX_GRAPHS of them a step
    says so in one line instead of failing inside torch's tracer (compiling is stubbed)."""
    from ss_mini.extras import compile as compile_mod
    monkeypatch.setattr(compile_mod, "MAX_GRAPHS", 2)
    monkeypatch.setattr(compile_mod, "_SEEN", {})
    monkeypatch.setattr(compile_mod, "_compile", lambda step, device: step)
    model = random_model(seed=1, std=0.4)
    step = compile_mod.compile_step(speculative_step)
    for spec in ("1,1", "2,1"):  # two graphs: within the limit, and the same tree again is free
        generate_speculative(model, [1, 2, 3], 8, make_tree(spec, 3), step=step)
        generate_speculative(model, [1, 2, 3], 8, make_tree(spec, 3), step=step)
    with pytest.raises(RuntimeError, match="speculative_step is compiled for 2 models"):
        generate_speculative(model, [1, 2, 3], 8, make_tree("3,1", 3), step=step)


# ---------------------------------------------------------------- drafts from the text

def test_lookup_finds_the_latest_longest_match():
    """The continuation of the latest earlier occurrence of the longest suffix (3, 2, then 1
    tokens), a loop continued past the end, None without a match; any token id up to 2**20."""
    assert lookup([5, 1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == [9, 2]  # 1,2,3 at 1 (not 2,3 at 5)
    assert lookup([4, 2, 3, 8, 2, 3], 3) == [8, 2, 3]  # 2,3 at 1; the end reached: it loops
    assert lookup([7, 7], 3) == [7, 7, 7]
    assert lookup([1, 2, 3], 2) is None and lookup([1], 2) is None
    big = [55_296, 60_000, 2**20 - 1]  # surrogate code points and beyond: still one character
    assert lookup(big + big[:2], 2) == [2**20 - 1, 55_296]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_streams_never_propose_the_texts_first_token(temperature):
    """Tree 2,1+L3: the root, the lookup chain L1..L3, then the stream nodes depth-first: a
    (depth 1), a' (its child), b (depth 1), b' (its child). When the streams' best token at depth
    1 is the lookup's first, a and b hold the next candidates (q_1 without it when sampling), so
    no two children of a node hold one token; sampling, the root and L1, L2 try the lookup's
    tokens first."""
    from ss_mini.step import draft_tree
    model = random_model(seed=0, n_streams=2)
    tree = make_tree("2,1+L3", 2).bind(model.config, "cpu", torch.float64)
    V, x = model.config.vocab_size, 5
    draft_logits = torch.randn(2, 2, V, generator=torch.Generator().manual_seed(0),
                               dtype=torch.float64)
    draft_logits[:, 0, x] = 10.0  # the streams' best at depth 1: the lookup's first token
    lookup = torch.tensor([[x, 6, 7], [x, 7, 6]])
    sampler = Sampler(temperature, None, None, 0, "cpu")
    draft = draft_tree(torch.tensor([1, 2]), draft_logits, tree, sampler, torch.tensor([99, 99]),
                       lookup)
    assert draft.tokens[:, 1:4].tolist() == lookup.tolist()
    a, b = draft.tokens[:, 4], draft.tokens[:, 6]
    assert (a != x).all() and (b != x).all() and (a != b).all()
    if temperature == 0:
        second = draft_logits[:, 0].topk(3).indices[:, 1:]  # the best two after x
        assert torch.equal(torch.stack([a, b], 1), second) and draft.look is None
    else:
        q_1 = draft.probs[:, 0]
        assert (q_1[:, x] == 0).all() and torch.allclose(q_1.sum(-1), q_1.new_ones(2))
        assert draft.look.tolist() == [[x, 6, 7] + [-1] * 5, [x, 7, 6] + [-1] * 5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("x", [1, 2])
def test_a_token_left_out_of_q_ranks_after_every_other(x, temperature):
    """Three tokens, token 0 the only one that top_p keeps in q, x left out (a lookup's): of two
    candidates the second is the token past q's support, never x, however keys of -inf tie."""
    logits = torch.tensor([[[9.0, 0.0, 0.0]]])
    for seed in range(10):
        sampler = Sampler(temperature, None, 0.5, seed, "cpu")
        ranked, q = sampler.draft(logits, 2, exclude=torch.tensor([[[x]]]))
        assert ranked.tolist() == [[[0, 3 - x]]]
        assert q is None or q[0, 0].tolist() == [1.0, 0.0, 0.0]


def test_drafts_from_the_text_carry_no_streams():
    """Tree 1+L3: the root, the lookup chain L1..L3, then the stream node s. Only the root and s
    carry streams: a path that ends at s takes s's streams for the next step, a path that ends
    in the chain its root's."""
    from ss_mini.step import Draft, accept, verify
    model = random_model(seed=0, n_streams=2)
    tree = make_tree("1+L3", 2).bind(model.config, "cpu", torch.float64)
    shape, V = tree.shape_for(1), model.config.vocab_size
    assert shape.stream_idx.tolist() == [[0, 4]]
    assert shape.next_draft_row.tolist() == [0, 0, 0, 0, 1]
    r, a, b, c = 1, 2, 3, 4
    main_logits = torch.zeros(1, 5, V, dtype=torch.float64)
    for node, target in enumerate([a, b, c, c, b]):
        main_logits[0, node, target] = 1.0
    stream_logits = torch.arange(2.0, dtype=torch.float64).view(1, 2, 1, 1).expand(1, 2, 1, V)
    for tokens, last, drafts_of in (([r, c, c, c, a], 4, 1),  # L1 rejected, s accepted
                                    ([r, a, b, a, 9], 2, 0)):  # the chain to L2: the root's
        draft = Draft(torch.tensor([tokens]), shape, None, None, None)
        sampler = Sampler(0.0, None, None, None, "cpu")
        verified = verify(draft, main_logits, sampler, torch.tensor([99]))
        assert int(verified.last[0]) == last
        cache = KVCache(model.config, tree.max_len, 1, dtype=torch.float64)
        step = accept(cache, draft, verified, stream_logits, tree)
        assert torch.equal(step.draft_logits, stream_logits[:, drafts_of])


@pytest.mark.parametrize("kw", SAMPLING, ids=["T1", "top_k", "top_p"])
def test_verify_with_a_draft_from_the_text_emits_the_target_distribution(kw):
    """50,000 nodes, each with 0 to 2 children drawn from q and a token from the text (any token,
    of probability 0 too, or none) tried first: the emitted tokens follow p exactly."""
    V, n = 6, 50_000
    gen = torch.Generator().manual_seed(1)
    base, logits, q_logits = _nodes_of_8_targets(gen, n, V)
    sampler = Sampler(kw["temperature"], kw.get("top_k"), kw.get("top_p"), 0, "cpu")
    ranked, q = sampler.draft(q_logits, 2)
    children = torch.arange(n) // 8 % 3  # 0, 1 or 2 children from q
    tries = (torch.arange(2) < children[:, None]).float()
    shape = SimpleNamespace(q_row=torch.arange(n), has_child=tries, max_children=2)
    look = torch.randint(-1, V, (n,), generator=gen)
    ys = sampler.verify(logits, q, ranked, shape, look)
    _assert_each_target_followed(ys, target_probs(base, **kw))
    assert 1000 < (ys == look).sum() < n - 1000  # drafts from the text accepted and rejected


@pytest.mark.parametrize("spec", ["1+L2", "2,1+L3", "L3"])
def test_lookup_branches_sample_exactly(spec):
    """A near-uniform model on 3 tokens after a periodic prompt: the lookup's drafts are often
    right and often the streams' best token too (which q_1 then leaves out). 64 rows x 40 seeds,
    pooled."""
    model = random_model(seed=1, std=0.1, vocab_size=3, n_streams=2, block_size=16)
    prompt, k, kw = [0, 1, 2, 0, 1, 2, 1], 4, dict(temperature=1.0)
    probs = _exact_first_tokens(model, prompt, k, **kw)
    counts = {}
    for i in range(40):
        outs, _ = generate_speculative(model, [prompt] * 64, k, make_tree(spec, 2), seed=i, **kw)
        for out in outs:
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    ok, stat, crit = _chi_square_ok(counts, probs, 64 * 40)
    assert ok, f"chi-square {stat:.1f} >= {crit:.1f}"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_lookup_that_finds_nothing_leaves_q1_whole(temperature):
    """A row whose last token never occurred before drafts -1s, never accepted, and takes no
    token out of q_1: the streams rank exactly as without a lookup branch."""
    tree = make_tree("2,1+L3", 3)
    assert tree.chains([[1, 2, 3], [1, 2, 1]]) == [[-1, -1, -1], [2, 1, 2]]
    q = torch.randn(2, 2, 11, dtype=torch.float64)
    for exclude, kept in ((torch.tensor([[[-1]], [[-1]]]), True),
                          (torch.tensor([[[4]], [[4]]]), False)):
        sampler = Sampler(temperature, None, None, 5, "cpu")
        got = sampler.draft(q, 11, exclude)[0]
        sampler = Sampler(temperature, None, None, 5, "cpu")
        want = sampler.draft(q, 11)[0]
        assert torch.equal(got, want) == kept
        assert kept or (got[:, 0, -1] == 4).all()  # left out: ranked last


def test_stats_count_the_accepted_drafts_from_the_text():
    """Stats.from_text: per pass, the accepted drafts that came from the lookup chain; none for
    a tree without one, some on a looping output, never more than the pass accepted."""
    model = random_model(seed=1, std=0.4)
    prompt = [1, 2, 3, 4] * 4
    _, plain = generate_speculative(model, prompt, 60, make_tree("1,1", 3))
    _, both = generate_speculative(model, prompt, 60, make_tree("1,1+L6", 3))
    assert set(plain.from_text) == {0} and len(both.from_text) == len(both.accepted)
    assert sum(both.from_text) > 0
    assert all(0 <= t <= a - 1 or (t == 0 and a == 0) for t, a in zip(both.from_text,
                                                                       both.accepted))
