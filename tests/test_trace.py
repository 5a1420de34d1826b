"""sample.py --trace: the recorded passes replay to the output, masks and trees are the ones
the passes used, the page is self-contained; bench.py --plot fails early without matplotlib."""
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch
from conftest import random_model

from ss_mini.io.cli import UsageError
from ss_mini.generate import generate_speculative
from ss_mini.extras.pruning import pruned_step
from ss_mini.lab.shapes import host_shape
from ss_mini.lab.trace import Trace, dense_mask, pass_data, to_html
from ss_mini.extras import make_tree

decode = lambda ids: "".join("abcdefghijk"[i] for i in ids)


def pruning_model():
    model = random_model(seed=5, std=0.4, prune_adapter_rank=4)
    with torch.no_grad():
        model.prune_adapter.up.weight.normal_(0, 0.3)  # an untrained adapter would be the identity
    return model


CASES = {  # name: (model, tree, decoding settings)
    "greedy chain": (lambda: random_model(seed=1, std=0.4), "1,1,1", {}),
    "greedy cartesian": (lambda: random_model(seed=2, std=0.4), "3,2,1", {}),
    "greedy budget": (lambda: random_model(seed=3, std=0.4), "n8", {}),
    "sampled cartesian": (lambda: random_model(seed=1, std=0.4), "2,2,1",
                          dict(temperature=1.0, seed=7)),
    "sampled budget": (lambda: random_model(seed=2, std=0.4), "n6",
                       dict(temperature=0.8, top_k=6, seed=3)),
    "sampled chain": (lambda: random_model(seed=4, std=0.4), "chain",
                      dict(temperature=1.2, top_p=0.9, seed=5)),
    "pruned cartesian": (pruning_model, "3,2,1", dict(prune_threshold=0.2)),
    "pruned budget": (pruning_model, "n16", dict(prune_threshold=0.2)),
    "greedy lookup": (lambda: random_model(seed=2, std=0.4), "2,1+L4", {}),
    "sampled lookup": (lambda: random_model(seed=1, std=0.4), "1,1+L3",
                       dict(temperature=1.0, seed=7)),
    "pruned lookup": (pruning_model, "2,1+L3", dict(prune_threshold=0.2)),
    "prompt lookup alone": (lambda: random_model(seed=2, std=0.4), "L4",
                            dict(temperature=1.0, seed=3)),
}


def decoding(model, kw):
    """The decoder's keyword arguments of a case: a pruned case's threshold is its step."""
    kw = dict(kw)
    if "prune_threshold" in kw:
        kw["step"] = pruned_step(model, kw.pop("prune_threshold"))
    return kw


def traced(case, prompt=(1, 2, 3), n=60):
    """Run a case with a trace and with a recorder of the masks the MSA layers received."""
    make_model, spec, kw = CASES[case]
    model = make_model()
    tree = make_tree(spec, model.config.n_drafts)
    used, steps = [], []
    top = model.forward_top

    def forward_top(x, mask=None, stream_idx=None, cache=None, draft_depth=None, main_idx=None):
        if main_idx is None:  # a tree pass wants the logits of every node, a prefill its last
            used.append(mask)
        return top(x, mask, stream_idx, cache, draft_depth, main_idx)

    model.forward_top = forward_top
    trace = Trace(decode, tree=spec)

    def observe(*args):
        step = pass_data(*args)
        probs = step["draft_probs"]
        steps.append(dict(q=step["draft_logits"].clone(),
                          probs=None if probs is None else probs.clone(), L=step["cache_length"]))
        trace.observe(*args)

    out, stats = generate_speculative(model, list(prompt), n, tree, observe=observe,
                                      **decoding(model, kw))
    return model, tree, kw, trace.finish(prompt, out), out, stats, used, steps


@pytest.mark.parametrize("case", list(CASES))
def test_trace_replays_to_the_output(case):
    model, tree, kw, data, out, stats, _, _ = traced(case)
    # each pass's accepted path (its root first), then the last pass's next root: the output
    replay = [t for p in data["passes"] for t in (p["nodes"][u]["token"] for u in p["path"])]
    replay.append(data["passes"][-1]["next_root"])
    assert replay[:len(out)] == out and len(replay) >= len(out)
    assert [p["emitted"] for p in data["passes"]] == stats.accepted
    assert [p["accepted"] for p in data["passes"]] == [len(p["path"]) for p in data["passes"]]
    assert [len(p["kept"]) for p in data["passes"]] == stats.nodes
    assert data["summary"]["tau"] == pytest.approx(stats.mean_accepted)
    assert "".join(c["text"] for c in data["chunks"]) == decode(out)
    for i, p in enumerate(data["passes"]):  # each pass's next root is the following pass's root
        nodes, path = p["nodes"], p["path"]
        if i + 1 < len(data["passes"]):
            assert data["passes"][i + 1]["root"] == p["next_root"]
        # the main stream's token at each path node is the next path token, then the next root
        assert ([nodes[u]["emitted"] for u in path]
                == [nodes[u]["token"] for u in path[1:]] + [p["next_root"]])
        for u, node in enumerate(nodes):
            status = node["status"]
            assert (status == "pruned") == (u in p["pruned"]) == (u not in p["kept"])
            if status == "rejected":  # the main stream wanted another token at its parent
                assert node["parent"] in path and node["token"] != nodes[node["parent"]]["emitted"]
            # only a node past the block's end
            elif status == "unreached" and node["parent"] in path:
                assert p["cache_length"] + node["depth"] > model.config.block_size - 1
            assert (status in ("root", "accepted")) == (u in path)
            assert ((node["source"] is None) == (u == 0)
                    and (node["rank"] < 0) == ("text" in str(node["source"])))
    # tracing changes nothing: the same call without it gives the same tokens (sampling included)
    make_model, spec, _ = CASES[case]
    fresh = make_model()
    assert generate_speculative(fresh, [1, 2, 3], 60, make_tree(spec, 3),
                                **decoding(fresh, kw))[0] == out
    if case.startswith("pruned"):
        assert any(p["pruned"] for p in data["passes"])  # this model and threshold do prune
    if case.endswith("lookup"):  # both sources had drafts accepted
        assert {"streams", "text"} <= set(data["summary"]["accepted_by_source"])


@pytest.mark.parametrize("case", list(CASES))
def test_trace_records_the_mask_and_tree_each_pass_used(case):
    model, tree, kw, data, out, stats, used, steps = traced(case)
    assert len(used) == len(data["passes"]) == len(steps)
    T = model.config.block_size
    for p, mask, step in zip(data["passes"], used, steps):
        L = p["cache_length"]
        # the pass's mask over the cache's slots (one row of the batch: KVCache.mask):
        # the prefix, then the pass's own rows, then slots it must not see
        keys = L + p["mask_keys"]
        assert mask.shape[:2] == (1, 1) and keys <= mask.shape[-1] <= tree.max_len
        mask = mask[0, 0]
        assert L == step["L"]
        assert torch.equal(dense_mask(p["mask"], L, p["mask_keys"]), mask[:, :keys] == 0)
        assert torch.isinf(mask[:, keys:]).all()
        n, g = len(p["kept"]), p["n_streams"]
        assert mask.shape[0] == n + len(p["carriers"]) * g == p["mask_keys"]
        if g:  # every node carries the streams but the drafts from the text (rank -1)
            ranks = [p["nodes"][u]["rank"] for u in p["kept"]]
            assert p["carriers"] == [i for i, r in enumerate(ranks) if r >= 0]
        # the drafted tree is the TreeShape the tree gives for these draft logits (and, when
        # sampling, the draft distribution that the candidates were drawn from)
        q, probs = step["q"][None], None if step["probs"] is None else step["probs"][None]
        shape = host_shape(tree.shape(q, probs, torch.tensor([T - 1 - L])))
        nodes = p["nodes"]
        assert [u["parent"] for u in nodes] == shape.parents
        assert [u["depth"] for u in nodes] == shape.depths
        assert [u["rank"] for u in nodes] == shape.ranks
        probs = torch.softmax(step["q"].double(), -1)
        ranked_q = step["q"].clone()  # a lookup tree's streams leave the text's first token out
        if len(ranked_q):
            # (a lookup that found nothing, -1s, leaves q_1 whole)
            ranked_q[0, [u["token"] for u in nodes[1:]
                         if u["rank"] < 0 and u["depth"] == 1 and u["token"] >= 0]] = -1e9
        for u in nodes[1:]:
            d = u["depth"] - 1
            if u["rank"] < 0:  # a draft from the text: no draft probability
                assert u["q_prob"] is None and "text" in u["source"]
                continue
            # greedy: the candidate of rank r is the r-th most probable
            if not kw.get("temperature"):
                assert u["token"] == torch.topk(ranked_q[d], u["rank"] + 1).indices[-1].item()
                assert u["q_prob"] == pytest.approx(probs[d, u["token"]].item(), rel=1e-5)
            else:
                assert 0.0 <= u["q_prob"] <= 1.0
                assert u["q_prob"] == pytest.approx(step["probs"][d, u["token"]].item(), rel=1e-5)


def test_trace_counts_a_pass_cut_by_end_of_text_as_stats_does():
    model, tree = random_model(seed=2, std=0.4), make_tree("3,2,1", 3)
    full, _ = generate_speculative(model, [1, 2, 3], 40, tree)
    for eot in sorted(set(full[5:30]))[:3]:  # tokens that end the output somewhere in the middle
        trace = Trace(decode, eot=eot)
        out, stats = generate_speculative(model, [1, 2, 3], 40, tree, eot=eot,
                                          observe=trace.observe)
        data = trace.finish([1, 2, 3], out)
        assert out == full[:full.index(eot)] and len(out) < 39
        assert [p["emitted"] for p in data["passes"]] == stats.accepted
        assert data["summary"]["tau"] == pytest.approx(stats.mean_accepted)
        assert "".join(c["text"] for c in data["chunks"]) == decode(out)


def test_trace_pages_are_self_contained_and_embed_the_data(tmp_path):
    *_, data, out, _, _, _ = traced("sampled budget", n=40)
    # text the page must not obey
    data["prompt"] = "see https://example.com and HTTP://x </script><b>"
    page = to_html(data)

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.scripts, self.in_script = [], [], False

        def handle_starttag(self, tag, attrs):
            self.tags.append((tag, dict(attrs)))
            self.in_script = tag == "script"
            if tag == "script":
                self.scripts.append("")

        def handle_endtag(self, tag):
            self.in_script = False if tag == "script" else self.in_script

        def handle_data(self, text):
            if self.in_script:
                self.scripts[-1] += text

    parser = Page()
    parser.feed(page)
    parser.close()
    assert not re.search(r"https?:", page, re.I)
    assert [t for t, a in parser.tags if t in ("link", "img", "iframe", "object")] == []
    assert all("src" not in a and "href" not in a for _, a in parser.tags)
    assert "@import" not in page and "url(" not in page
    assert len(parser.scripts) == 1
    blob = re.search(r"const DATA = (.*?);\n", parser.scripts[0]).group(1)
    assert json.loads(blob) == data
    assert json.loads(json.dumps(data)) == data  # the .json file round-trips


def test_trace_save_writes_whole_files_or_nothing(tmp_path, monkeypatch):
    *_, data, _, _, _, _ = traced("greedy budget", n=20)
    trace = Trace(decode)
    trace.data = data
    for name in ("t.json", "t.html"):
        path = tmp_path / name
        path.write_text("old")
        trace.save(str(path))
        assert path.read_text() != "old"
    assert json.loads((tmp_path / "t.json").read_text()) == data
    # fails before anything is written
    monkeypatch.setattr("ss_mini.lab.trace.to_html", lambda d: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        trace.save(str(tmp_path / "t.html"))
    writes = []
    monkeypatch.setattr("ss_mini.lab.trace.os.replace", lambda a, b: writes.append((a, b)) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # fails after the temp file, before the replace
        trace.save(str(tmp_path / "t.json"))
    assert os.path.dirname(writes[0][0]) == str(tmp_path)
    assert writes[0][1] == str(tmp_path / "t.json")
    assert sorted(os.listdir(tmp_path)) == ["t.html", "t.json"]  # no temp file left behind
    assert json.loads((tmp_path / "t.json").read_text()) == data
    assert "const DATA" in (tmp_path / "t.html").read_text()


@pytest.mark.parametrize("args, message", [
    (["--speculative", "--trace={tmp}/missing/t.html"], "does not exist"),
    (["--speculative", "--trace={tmp}/t.txt"], "ending in .html"),
    (["--speculative", "--trace={tmp}"], "ending in .html"),
    (["--trace={tmp}/t.html"], "add --speculative"),
])
def test_sample_trace_bad_paths_fail_before_decoding(tmp_path, args, message):
    import sample
    argv = [a.format(tmp=tmp_path) for a in args] + [f"--out_dir={tmp_path}/no-such-checkpoint"]
    with pytest.raises(ValueError, match=message):  # not the missing checkpoint: nothing was loaded
        sample.main(argv)


def test_sample_trace_writes_the_page(tiny_ckpt, tmp_path, capsys):
    import sample
    path = tmp_path / "trace.html"
    path.write_text("an older trace")
    sample.main([f"--out_dir={tiny_ckpt}", "--speculative", "--tree=3,2,1", "--max_new_tokens=30",
                 "--start=def ", f"--trace={path}", "--device=cpu"])
    page = path.read_text()
    data = json.loads(re.search(r"const DATA = (.*?);\n", page).group(1))
    assert data["prompt"] == "def " and len(data["output"]) == 30 and data["passes"]
    captured = capsys.readouterr()
    first_sample = captured.out.split("\n---------------\n")[0]
    assert first_sample == "def " + "".join(c["text"] for c in data["chunks"])
    assert os.listdir(tmp_path) == ["trace.html"]
    # the statistics count every forward pass, the trace only the decode passes: both say so
    assert re.search(r", \d+ forward passes \(the prefill and any window rebuilds included\), ",
                     captured.err)
    assert (f"trace of {len(data['passes'])} decode passes (the prefill and window rebuilds are "
            "not traced) written to") in captured.err


def test_bench_plot_without_matplotlib_is_one_line_error(monkeypatch, tmp_path):
    import bench
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UsageError, match=r'pip install -e "\.\[plot\]"'):
        bench.main([f"--plot={tmp_path}/search.png", f"--out_dir={tmp_path}/no-such-checkpoint"])


def test_bench_plot_draws_the_tree_search(tmp_path):
    pytest.importorskip("matplotlib")
    from ss_mini.lab import plot
    with pytest.raises(UsageError, match="--tree=auto or --sweep"):
        plot.check(str(tmp_path / "s.png"), searched=False)
    with pytest.raises(UsageError, match="does not exist"):
        plot.check(str(tmp_path / "missing" / "s.png"))
    rows = [(spec, n, dict(speedup=s, mean_accepted=t)) for spec, n, s, t in
            [("1,1,1", 4, 1.3, 2.0), ("3,2,1", 16, 1.1, 2.4), ("n8", 8, 1.4, 2.2),
             ("n16", 16, 1.2, 2.5)]]
    path = tmp_path / "s.png"
    path.write_bytes(b"old")
    plot.tree_search(rows, "n8", str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(tmp_path) == ["s.png"]


def test_what_trace_and_plot_write_beside_the_scripts_stays_out_of_git():
    """trace.html and --plot's figures written at the top level are ignored; docs/ figures are
    not."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if shutil.which("git") is None or not os.path.exists(os.path.join(root, ".git")):
        pytest.skip("not a git checkout")

    def ignored(path):
        return subprocess.run(["git", "check-ignore", "--no-index", "-q", path],
                              cwd=root).returncode == 0

    for path in ("trace.html", "search.png", "sweep.png", "search.svg", "search.pdf"):
        assert ignored(path), path
    assert not ignored("docs/trace.png") and not ignored("docs/sweep.png")
