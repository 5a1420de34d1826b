"""The verify rule one node at a time (`verify_reference`), against the vectorised
`Sampler.verify`; and the small defects that reading the code found."""
import pytest
import torch
from conftest import random_model

from ss_mini.lab.shapes import host_shape
from ss_mini.extras.distill import greedy_continuation
from ss_mini.generate import generate_speculative
from ss_mini.sampling import Sampler
from ss_mini.extras import make_tree
from ss_mini.extras.budget_tree import BudgetTree
from ss_mini.tree import CartesianTree


def verify_reference(p, q, ranked, shape, u, race_u):
    """Speculative sampling on a tree, one node and one child at a time (see Sampler's docstring).

    p: (n, V) the target's distribution at each node; q: (depths, V) the draft distribution of
    each depth; ranked: (depths, width) the candidates of each depth, in the order drawn;
    shape: the TreeShape (depths, ranks, children); u: (n, width) a uniform per child try, in
    the children's order; race_u: (n, V) the uniforms of the final draw.
    Returns the token emitted at each node."""
    ys = []
    for node in range(shape.n_nodes):
        row = shape.depths[node]  # the depth below this node, whose candidates its children hold
        p_node = p[node].clone()
        q_node = q[row].clone() if shape.children[node] else None
        y = None
        for r, child in enumerate(shape.children[node]):  # in rank order
            x = ranked[row, shape.ranks[child]].item()
            # accept with probability min(1, p(x)/q(x))
            if u[node, r] * q_node[x] < min(p_node[x], q_node[x]):
                y = x
                break
            # rejected: p becomes the residual max(0, p - q) ...
            p_node = (p_node - q_node).clamp_min(0)
            if p_node.sum() > 0:
                p_node = p_node / p_node.sum()  # ... normalised
            # x leaves q, which is renormalised (if anything is left: else nothing can be accepted)
            q_node[x] = 0
            if q_node.sum() > 0:
                q_node = q_node / q_node.sum()
        if y is None:  # none accepted: a draw from the residual (from p if it underflowed to zero)
            weights = p_node if p_node.sum() > 0 else p[node]
            y = (race_u[node].log() / weights).argmax().item()
        ys.append(y)
    return torch.tensor(ys)


def _random_logits(seed, V, ties):
    """Target logits for up to 16 nodes and draft logits for 3 depths, near them; with ties,
    equal probabilities in both."""
    gen = torch.Generator().manual_seed(seed)
    main_logits = torch.randn(16, V, generator=gen, dtype=torch.float64) * 2
    draft_logits = main_logits[:3] + torch.randn(3, V, generator=gen, dtype=torch.float64)
    if ties:
        main_logits[:, :3] = main_logits[:, :1]
        draft_logits[:, 1:4] = 0.5
    return main_logits, draft_logits


@pytest.mark.parametrize("tree", ["1,1,1", "3,2,1", "2,2,2", "5,1", "n8", "n16"])
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=2),
                                dict(temperature=1.3, top_p=0.5),
                                dict(temperature=1.0, ties=True)],
                         ids=["T1", "top_k2", "top_p", "ties"])
def test_vectorised_verify_is_the_reference_rule(tree, kw):
    """The same tokens from the same uniforms, on random trees, p and q; with top_k=2 and top_p
    q's support is often smaller than a depth's width (candidates never drawn)."""
    kw = dict(kw)
    ties = kw.pop("ties", False)
    config = random_model().config
    t = make_tree(tree, 3).bind(config, "cpu", torch.float64)
    for seed in range(25):
        main_logits, draft_logits = _random_logits(seed, config.vocab_size, ties)
        # a batch of one row, as speculative_step drafts it
        draft_logits = draft_logits[None, :t.draft_depth]
        sampler = Sampler(kw["temperature"], kw.get("top_k"), kw.get("top_p"), seed, "cpu")
        ranked, draft_probs = sampler.draft(draft_logits, t.width)
        shape = t.shape(draft_logits, draft_probs, depth_limit=torch.tensor([3]))
        n = shape.n_nodes
        p = sampler.probs(main_logits[:n])
        state = sampler.gen.get_state()
        ys = sampler.verify(main_logits[None, :n], draft_probs, ranked, shape)
        assert ys.shape == (1, n)
        sampler.gen.set_state(state)  # the same uniforms, in the order verify draws them
        u = torch.rand((n, t.width), generator=sampler.gen, dtype=p.dtype)
        race_u = torch.empty_like(p).uniform_(generator=sampler.gen)
        ref = verify_reference(p, draft_probs[0], ranked[0], host_shape(shape), u, race_u)
        assert ys[0].tolist() == ref.tolist(), (seed, ys.tolist(), ref.tolist())


def test_a_residual_that_underflows_falls_back_to_the_target(monkeypatch):
    """When p - q underflows to all zeros (p ~ q), the emitted token comes from p, never the
    token 0 that an argmax over all -inf keys would give. Simulated with p = q / 2 after
    normalisation: a rejection then leaves max(0, p - q) = 0 everywhere."""
    V = 5
    q = torch.tensor([[0.0, 0.0, 0.2, 0.3, 0.5]], dtype=torch.float64)
    sampler = Sampler(1.0, None, None, 0, "cpu")
    monkeypatch.setattr(sampler, "probs", lambda logits: q.expand(len(logits), V) / 2)
    shape = type("Shape", (), dict(q_row=torch.zeros(400, dtype=torch.long),
                                   has_child=torch.ones(400, 1), max_children=1))()
    ranked = torch.tensor([[4]])
    ys = sampler.verify(torch.zeros(400, V), q, ranked, shape)
    assert set(ys.tolist()) <= {2, 3, 4} and (ys != 4).any(), ys.bincount()


def test_a_draft_certain_in_float32_leaves_the_next_child_its_chance():
    """q(x) rounds to exactly 1 in float32 while the other tokens keep ~1e-13 each. Rejecting x
    must leave q on the rest renormalised by what is left (1 - q(x) is 0 and would blow it up)
    and p uniform on the rest, so the next child is always accepted: the node emits x with
    p(x) = 1/8 and the second child otherwise, never another token (a node with two children
    in a tree of up to three)."""
    V, n = 8, 20_000
    q = torch.softmax(torch.tensor([40.0] + [10.0] * (V - 1)), -1)[None]
    assert q[0, 0] == 1.0 and (q[0, 1:] > 0).all()
    shape = type("Shape", (), dict(q_row=torch.zeros(n, dtype=torch.long),
                                   has_child=torch.tensor([[1.0, 1.0, 0.0]]).expand(n, 3),
                                   max_children=3))()
    ys = Sampler(1.0, None, None, 0, "cpu").verify(torch.zeros(n, V), q, torch.tensor([[0, 1, 2]]),
                                                 shape)
    counts = ys.bincount(minlength=V)
    assert counts[2:].sum() == 0 and abs(counts[0] / n - 1 / 8) < 0.01, counts.tolist()


def test_tau_counts_what_a_pass_emitted():
    """A pass cut short by max_new_tokens counts the tokens it gave, not its whole path:
    the prefill's token plus the passes' tokens are the output."""
    model = random_model(seed=3, std=0.6)
    for n in (1, 2, 7, 11):
        out, stats = generate_speculative(model, [1, 2], n, CartesianTree([1, 1, 1]))
        assert len(out) == n and 1 + sum(stats.accepted) == n, (n, stats.accepted)


def test_greedy_continuation_ignores_dropout():
    """The greedy teacher of stream_targets="greedy" is the model's own greedy path, even when
    called in training mode with dropout on, and it leaves the model in the mode it found."""
    model = random_model(std=0.3, dropout=0.5, stream_targets="greedy")
    idx = torch.randint(0, 11, (2, 9))
    model.eval()
    want = greedy_continuation(model, idx)
    model.train()
    torch.manual_seed(0)
    got = greedy_continuation(model, idx)
    assert model.training
    torch.testing.assert_close(got, want)


def test_what_a_tree_keeps_is_bounded_in_bytes():
    """A budget tree meets a new shape for many drafts, in every row of a batch; what it keeps
    between steps (its template, and a Cartesian tree's one shape per batch size) stays under a
    byte bound and does not grow with the shapes it has made."""
    def held(obj, seen=None):
        """Bytes of the tensors an object keeps in its attributes (and theirs), each counted
        once."""
        seen = set() if seen is None else seen
        total = 0
        for v in (vars(obj).values() if hasattr(obj, "__dict__")
                  else obj.values() if isinstance(obj, dict)
                  else obj if isinstance(obj, (list, tuple)) else []):
            if isinstance(v, torch.Tensor):
                if v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    total += v.untyped_storage().nbytes()
            elif hasattr(v, "__dict__") or isinstance(v, (dict, list, tuple)):
                total += held(v, seen)
        return total

    config = random_model().config
    gen = torch.Generator().manual_seed(0)
    for t in (BudgetTree(8), CartesianTree([2, 2, 1])):
        t.bind(config, "cpu", torch.float32)
        # a budget tree keeps its template only
        bound = held(t) if isinstance(t, BudgetTree) else None
        t.shape(torch.randn(3, 3, config.vocab_size, generator=gen) * 3,
                depth_limit=torch.tensor([3, 2, 1]))
        first = held(t)
        for _ in range(200):
            shape = t.shape(torch.randn(3, 3, config.vocab_size, generator=gen) * 3,
                            depth_limit=torch.tensor([3, 2, 1]))
            assert shape.n_nodes == len(t)
            assert held(t) == first, (t, held(t), first)
        if bound is not None:
            assert first == bound <= 20_000, (t, first, bound)
        else:  # a Cartesian tree's one shape, made once for a batch of 3 rows and reused
            assert t.shape(torch.randn(3, 3, config.vocab_size, generator=gen),
                           depth_limit=torch.tensor([3, 2, 1])) is shape


def test_the_race_never_takes_log_zero(monkeypatch):
    """torch.rand can return exactly 0. The race's key log(U) / w must stay finite for a token of
    weight w > 0 (log 0 = -inf would tie it with the tokens of weight 0, and argmax would pick
    the first of them: a token of probability 0); tokens of weight 0 get -inf."""
    from ss_mini.sampling import _race
    weights = torch.tensor([[0.0, 0.0, 0.7, 0.0, 0.3], [0.0, 0.0, 0.0, 1.0, 0.0]],
                           dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        w = weights.to(dtype)
        keys = _race(w, torch.zeros_like(w))
        assert torch.isfinite(keys[w > 0]).all() and (keys[w == 0] == -torch.inf).all()
        assert keys.argmax(-1).tolist() == [2, 3]  # U = 0 for all: the largest weight wins
        u = torch.tensor([[0.5, 0.5, 0.0, 0.5, 0.5], [0.1, 0.9, 0.5, 0.0, 0.3]], dtype=dtype)
        keys = _race(w, u)
        assert torch.isfinite(keys[w > 0]).all() and keys.argmax(-1).tolist() == [4, 3]
    # through the Sampler: every uniform it draws is 0, and the only token of nonzero probability
    # (top_k=1) is still the one picked, drafted first and emitted where a draft is rejected
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, device=None, dtype=None, **kw:
                        torch.zeros(*shape, device=device, dtype=dtype or torch.float32))
    sampler = Sampler(1.0, 1, None, 0, "cpu")
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [4.0, 0.0, 1.0, 5.0]])
    assert sampler.pick(logits).tolist() == [2, 3]
    ranked, probs = sampler.draft(logits[None], 2)
    assert ranked[0, :, 0].tolist() == [2, 3]
    shape = type("Shape", (), dict(q_row=torch.zeros(2, dtype=torch.long),
                                   has_child=torch.ones(2, 1), max_children=1))()
    # q: the draft always proposes token 0, which p never emits
    other = torch.tensor([[4.0, 0.0, 0.0, 0.0]])
    _, q = Sampler(1.0, 1, None, 0, "cpu").draft(other, 1)
    ys = sampler.verify(logits, q, torch.zeros(1, 1, dtype=torch.long), shape)
    assert ys.tolist() == [2, 3]
