"""bench.py: the tree search's choice (ss_mini/lab/tree_choice.py), repeated runs, --suite and its
worked example (ss_mini/lab/suite.py)."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import bench
from conftest import fake_tree_search, random_model
from ss_mini.baseline import generate_ar
from ss_mini.extras import make_tree
from ss_mini.generate import generate_speculative
from ss_mini.lab import lockstep, measure, step_cost
from ss_mini.lab.measure import over_runs
from ss_mini.lab.report import shell_quote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, cwd=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=600)


def search(monkeypatch, timings, **cfg):
    """The tree search's choice on fake decoders (conftest.fake_tree_search), and the
    max_new_tokens of every call."""
    best, _, calls = fake_tree_search(monkeypatch, timings, **cfg)
    return best, [tokens for _, _, tokens in calls]


def test_tree_search_takes_the_smallest_tree_within_the_tie_margin(monkeypatch):
    # speedups against 24 ms of AR: n8 (8 nodes) 2.0x, 1,1,1,1 (5 nodes) 1.92x, 1,1 (3 nodes) 1.6x
    timings = {"n8": (4, 2.0), "1,1,1,1": (4, 2.083), "1,1": (3, 1.875)}
    assert search(monkeypatch, timings, tie_margin=0.0)[0] == "n8"  # the fastest
    assert search(monkeypatch, timings, tie_margin=0.05)[0] == "1,1,1,1"  # 4% slower, 4 nodes fewer
    assert search(monkeypatch, timings, tie_margin=0.25)[0] == "1,1"
    # two trees of 4 nodes within the margin: the higher tau
    timings = {"n4": (3, 1.5), "1,1,1": (4, 2.0), "n8": (4, 1.95)}
    assert search(monkeypatch, timings, tie_margin=0.05)[0] == "1,1,1"


def test_among_near_ties_over_whole_decodes_the_busiest_tree_wins(monkeypatch):
    # busy (all rows decoding): 1,1 1.6x, 1,1,1 2.0x; a drain makes both 1.6x over the whole decode
    timings = {"1,1": (2, 1.25), "1,1,1": (4, 2.0)}
    assert search(monkeypatch, timings, drain={"1,1,1": 1.25})[0] == "1,1,1"
    # a tree whose drain costs it more than the margin is out, however busy: the search errs
    # toward plain decoding
    assert search(monkeypatch, timings, drain={"1,1,1": 1.3})[0] == "1,1"
    # a wide margin keeps both on both counts: the fewest nodes
    assert search(monkeypatch, timings, drain={"1,1,1": 1.25}, tie_margin=0.25)[0] == "1,1"


def test_a_slow_spell_on_one_prompt_does_not_decide_the_search(monkeypatch):
    # 1,1,1 is 2.0x on every prompt but p1, where the machine slowed it 4x; 1,1 is 1.6x everywhere:
    # over the sum of the three decodes 1,1,1 would lose (1.2x), over the median prompt it wins
    timings = {"1,1": (2, 1.25), "1,1,1": (4, 2.0)}
    best, rows, _ = fake_tree_search(monkeypatch, timings, prompts=("p0", "p1", "p2"),
                                     slow={("1,1,1", "p1"): 4}, tie_margin=0.0)
    assert best == "1,1,1" and [round(r["speedup"], 2) for _, _, r in rows] == [1.6, 2.0]


def test_tree_search_decodes_calibration_tokens(monkeypatch):
    timings = {"1,1": (2, 1.2), "n4": (3, 1.5)}
    _, asked = search(monkeypatch, timings, calibration_tokens=100)
    # a short warm-up of each decoder, then the search
    assert asked[:3] == [32] * 3 and set(asked[3:]) == {100}
    _, asked = search(monkeypatch, timings, calibration_tokens=1000)
    assert set(asked[3:]) == {256}  # never more than max_new_tokens


def test_lockstep_decoders_take_turns_pass_by_pass(monkeypatch):
    """The search's timing (ss_mini/lab/lockstep.py): the decoders decode as they would alone,
    one pass each in turn while both are going, and each one's clock counts only its turns."""
    model, tree = random_model(std=0.3), make_tree("1,1", 3)
    kw = dict(max_new_tokens=12, temperature=0.8, seed=3)
    alone = [generate_ar(model, p, **kw)[0] for p in ([1, 2, 3], [4, 5])]
    alone_ss = [generate_speculative(model, p, tree=tree, **kw)[0] for p in ([1, 2, 3], [4, 5])]
    turns = []
    for name in ("ar_step", "speculative_step"):
        real = getattr(lockstep, name)
        monkeypatch.setattr(lockstep, name, (lambda real, name: lambda *a, **k: turns.append(
            name) or real(*a, **k))(real, name))
    t0 = time.perf_counter()
    ar, ss = lockstep.run_lockstep(model, [[1, 2, 3], [4, 5]], [None, tree], kw)
    wall = time.perf_counter() - t0
    assert [out for out, _ in ar] == alone and [out for out, _ in ss] == alone_ss
    both = 2 * min(st.passes for _, st in ss) - 2  # passes while both decode (prefill left out)
    assert turns[:both] == ["ar_step", "speculative_step"] * (both // 2)
    assert sum(st.seconds for _, st in ar + ss) < wall  # each clock stops while it waits


def test_a_lockstep_decoder_that_fails_stops_none_of_the_others(monkeypatch):

    def fail(*a, **kw):
        raise ValueError("a tree that does not fit")
    monkeypatch.setattr(lockstep, "generate_speculative", fail)
    with pytest.raises(ValueError, match="does not fit"):
        lockstep.run_lockstep(random_model(), [[1, 2]], [make_tree("1,1", 3), None],
                              dict(max_new_tokens=4))


def test_over_runs_gives_the_median_run_and_the_range():
    runs = [dict(speedup=x, mean_accepted=x, match_rate=m)
            for x, m in ((1.9, 1.0), (1.5, 1.0), (1.7, 0.5))]
    r = over_runs(runs)
    assert r["speedup"] == r["mean_accepted"] == 1.7 and r["median_run"] == 2
    assert r["speedup_range"] == [1.5, 1.9]
    assert r["speedups"] == [1.9, 1.5, 1.7] and r["match_rate"] == 0.5  # the worst run's
    assert over_runs(runs[:2])["speedup"] == 1.5  # an even count: the lower middle run


def test_bench_warms_up_the_tree_it_measures_and_repeats(tiny_ckpt, monkeypatch, capsys):
    """One tree search, then --repeats runs on the reported prompts, all with the tree object
    that was warmed up on the calibration prompts."""
    real = bench.generate_speculative
    seen = []

    def spy(model, prompt, tree, **kw):
        seen.append((id(tree), repr(tree), tuple(prompt)))
        return real(model, prompt, tree=tree, **kw)

    monkeypatch.setattr(bench, "generate_speculative", spy)
    monkeypatch.setattr(measure, "generate_speculative", spy)  # run_pair's
    result = bench.main([f"--out_dir={tiny_ckpt}", "--num_prompts=2", "--max_new_tokens=12",
                         "--prompt_tokens=16", "--candidates=1,1;n4", "--repeats=2"])
    assert len(result["speedups"]) == 2 and result["speedup"] == min(result["speedups"])
    assert result["speedup_range"] == [min(result["speedups"]), max(result["speedups"])]
    # 2 runs x 2 prompts of the tree, and of the lookup baseline beside it
    lookup = [s for s in seen[-8:] if s[1] == "L4"]
    measured = [s for s in seen[-8:] if s[1] != "L4"]
    assert len(lookup) == 4 and result["lookup_only"]["tree"] == "L4"
    assert len(measured) == 4 and len({t for t, _, _ in measured}) == 1
    assert measured[0][1] == result["tree"]
    warmed = [p for t, _, p in seen[:-8] if t == measured[0][0]]
    # warmed up on the calibration prompts
    assert warmed and not set(warmed) & {p for _, _, p in measured}
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"Speculative Streaming speedup {result['speedup']:.2f}x")
    assert f"tree {result['tree']}" in out[0]
    assert "greedy" in out[0] and "over 2 runs" in out[0]
    assert out[1].startswith("prompt lookup (L4): ") and "(a baseline, not the method)" in out[1]
    repeats = out[2].startswith("most of this speedup is drafting repeated text")
    assert (result["repeat_rate"] > 0.5) == repeats
    assert "93%" in bench.repeats_note(0.93) and bench.repeats_note(0.5) == ""


def test_sampled_runs_draw_with_seeds_in_turn(tiny_ckpt, monkeypatch, capsys):
    """Sampling, run i of --repeats decodes with --seed + i in both decoders, so the range holds
    the draws' spread; greedy runs keep the one seed (the same decode)."""
    seeds = []
    for name in ("generate_speculative", "generate_ar"):
        real = getattr(bench, name)
        spy = (lambda real: lambda *a, **kw: seeds.append(kw["seed"]) or real(*a, **kw))(real)
        monkeypatch.setattr(bench, name, spy)
        monkeypatch.setattr(measure, name, spy)
    bench.main([f"--out_dir={tiny_ckpt}", "--num_prompts=1", "--max_new_tokens=8",
                "--prompt_tokens=16", "--tree=1,1", "--repeats=3", "--temperature=0.8",
                "--seed=7"])
    assert seeds[-9:] == [7] * 3 + [8] * 3 + [9] * 3  # plain, tree, lookup baseline per run
    assert "over 3 runs, seeds 7 to 9)" in capsys.readouterr().out.splitlines()[0]
    assert measure.run_kwargs({"temperature": 0.0, "seed": 7}, 2)["seed"] == 7


def test_timings_wait_for_the_device(monkeypatch):
    """synchronize waits on CUDA and on MPS (else the timers see kernel launches), and every
    timer uses it."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: calls.append(("cuda", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append(("mps", None)))
    for device in ("cpu", "cuda:1", "mps", torch.device("mps")):
        measure.synchronize(device)
    assert calls == [("cuda", "cuda:1"), ("mps", None), ("mps", None)]
    seen = []
    monkeypatch.setattr(measure, "synchronize", seen.append)
    measure.copy_bandwidth("cpu", mb=1, repeats=1)
    assert seen == ["cpu", "cpu"]
    monkeypatch.setattr(step_cost, "synchronize", seen.append)
    args = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=5, n_streams=1,
                n_msa_layers=1)
    step_cost.train_bench(dict(config=dict(batch_size=2, block_size=8), model_args=args), "cpu",
                          1, lambda *a: None)
    assert seen[2:] == ["cpu"] * 6  # 3 steps (2 warm-up) of 2 models


def test_shell_quote_survives_bash():
    for text in ("def f(x):", "it's\n\tx = '\\\\'\n", "\x0cform feed é ☃", "a b; $HOME `ls`"):
        r = subprocess.run(["bash", "-c", f"printf %s {shell_quote(text)}"], capture_output=True,
                           text=True)
        assert r.stdout == text


def test_suite_needs_its_checkpoints(tiny_ckpt, tmp_path):
    r = run("--suite", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: --suite needs out/ckpt.pt: make it with `python train.py`, or point "
        "--suite_dirs=CODE_DIR,PROSE_DIR at other checkpoints"]
    r = run("--suite", f"--suite_dirs={tiny_ckpt},{tmp_path}/prose", cwd=tmp_path)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert f"`python train.py --dataset=shakespeare --out_dir={tmp_path}/prose`" in r.stderr


def test_suite_json_and_its_worked_example(tiny_ckpt):
    r = run("--suite", f"--suite_dirs={tiny_ckpt},{tiny_ckpt}", "--num_prompts=3",
            "--max_new_tokens=16", "--prompt_tokens=16", "--candidates=1,1;n4",
            "--calibration_tokens=8", "--repeats=2", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    rows = doc["rows"]
    assert [(row["prompts"], row["decoding"]) for row in rows] == [
        ("held-out", "greedy"), ("held-out", "T = 0.8"), ("prompts/code_unseen.jsonl", "greedy"),
        ("held-out", "greedy"), ("held-out", "T = 0.8"), ("prompts/prose_unseen.jsonl", "greedy")]
    for row in rows:
        low, high = row["speedup_range"]
        assert len(row["speedups"]) == 2 and low <= row["speedup"] <= high
        assert row["tree"] in ("1,1", "n4") and 0 <= row["repeat_rate"] <= 1
        assert row["mean_accepted"] >= 1
        assert row["match_rate"] == 1.0 or row["temperature"] > 0
    assert rows[1]["command"].startswith(f"python bench.py --out_dir={tiny_ckpt} --temperature=0.8")
    machine = doc["machine"]
    assert machine["threads"] >= 1 and machine["torch"] and machine["processor"]
    assert doc["checkpoints"][0]["corpus"]["sha256"]
    # the Markdown
    assert "| model | text | decoding |" in r.stderr and "### Worked example" in r.stderr
    # the pick's check on the first checkpoint: every candidate --repeats times, the Markdown
    # says how many of each
    assert set(rows[0]["pick_check"]["speedups"]) == {"1,1", "n4"}
    assert rows[0]["pick_check"]["runs"] == 2
    assert "Each of the 2 candidates with stream nodes on the measured prompts of the first " \
        "checkpoint, the median of 2 runs each:" in r.stderr
    ex = doc["worked_example"]
    taus = ex["greedy_taus"]  # of the first row's prompts: the example is the one in the middle
    assert len(taus) == 3 and ex["greedy"]["tau"] == taus[ex["prompt_index"]] == sorted(taus)[1]
    for mode in ("greedy", "sampled"):  # the commands decode what bench decoded
        speculative, plain = ex[mode]["commands"]
        assert speculative == plain + f" --speculative --tree={ex[mode]['tree']}"
        command = speculative.replace("python sample.py", f"{sys.executable} sample.py", 1)
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout == ex["prompt"] + ex[mode]["continuation"] + "\n---------------\n"
        assert f"{ex[mode]['tau']:.2f} tokens per pass" in out.stderr
    command = ex["greedy"]["commands"][1].replace("python sample.py", f"{sys.executable} sample.py",
                                                  1)
    plain = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT,
                           timeout=120)
    assert plain.stdout == ex["prompt"] + ex["greedy"]["continuation"] + "\n---------------\n"


def test_the_search_reports_the_streams_even_where_no_tree_pays(monkeypatch):
    """bench measures Speculative Streaming: its pick is a tree with stream nodes even where
    plain decoding is faster (1,1 takes 12 passes of 3 ms where plain decoding takes 24 of 1)."""
    best, rows, _ = fake_tree_search(monkeypatch, {"none": (1, 1.0), "1,1": (2, 3.0)})
    assert best == "1,1" and [(spec, n) for spec, n, _ in rows] == [("none", 0), ("1,1", 3)]


def test_the_answer_has_stream_nodes_and_prompt_lookup_is_a_baseline(monkeypatch):
    """Where prompt lookup alone (L12, 4x) beats every tree with streams, the answer is still
    the fastest tree with stream nodes (1+L8, 1.6x); the lookup is the fastest of its kind."""
    from ss_mini.lab.tree_choice import METHOD, kind
    timings = {"none": (1, 1.0), "L12": (8, 2.0), "1,1": (2, 1.5), "1+L8": (4, 2.5)}
    best, rows, _ = fake_tree_search(monkeypatch, timings)
    assert best == "1+L8" and kind(best) in METHOD
    fastest = max(rows, key=lambda row: row[2]["speedup"])
    assert fastest[0] == "L12" and kind("L12") == "prompt lookup" and kind("n8") == "streams"


def test_a_tree_must_clear_the_noise_of_plain_decoding_against_itself(monkeypatch):
    """1,1 gains 5% (12 passes of 1.9 ms against 24 of 1 ms), more than the tie margin: chosen
    when plain decoding measures 1.00x against itself, but not when the search's prompts put
    plain decoding 9% away from itself (its noise); a tree that gains more is still chosen."""
    from ss_mini.lab.tree_choice import pick
    best, rows, _ = fake_tree_search(monkeypatch, {"none": (1, 1.0), "1,1": (2, 1.9)})
    assert best == "1,1" and rows[1][2]["speedup"] == pytest.approx(24 / 22.8)
    assert pick(rows, noise=0.09, tie_margin=0.02)[0] == "none"
    assert pick(rows, noise=0.04, tie_margin=0.02)[0] == "1,1"
    assert pick(rows[1:], noise=0.09, tie_margin=0.02)[0] == "1,1"  # no plain candidate


def test_a_suite_row_that_decodes_plainly_is_in_the_table(tiny_ckpt, monkeypatch, capsys):
    """A row whose tree search picks plain decoding (the tree `none`) is measured and reported
    like the others: tree none, speedup 1.00x, in the JSON and in the Markdown."""
    from ss_mini.lab import suite
    real = suite.choose_trees

    def search(model, calibration, cfg, kw, log):  # the sampled rows' search can only pick none
        candidates = "none" if cfg["temperature"] else "1,1"
        return real(model, calibration, dict(cfg, candidates=candidates), kw, log)

    monkeypatch.setattr(suite, "choose_trees", search)
    doc = bench.main(["--suite", f"--suite_dirs={tiny_ckpt}+{tiny_ckpt},{tiny_ckpt}",
                      "--num_prompts=2", "--max_new_tokens=8", "--prompt_tokens=16",
                      "--calibration_tokens=8", "--repeats=2"])
    rows = doc["rows"]
    assert [(row["decoding"], row["tree"]) for row in rows] == [
        ("greedy", "1,1"), ("T = 0.8", "none"), ("greedy", "1,1")] * 2
    for row in rows[1::3]:
        assert row["tree_nodes"] == 0 and row["speedup"] == 1.0
        assert row["speedups"] == [1.0] * 2 * len(row["checkpoints"])
    assert [len(row["checkpoints"]) for row in rows] == [2, 2, 2, 1, 1, 1]
    assert doc["worked_example"]["sampled"]["tree"] == "none"
    out = capsys.readouterr().out.split("\n\n")  # the Markdown's paragraphs and tables
    table = next(p for p in out if p.startswith("| model | text | decoding | plain")).splitlines()
    assert len(table) == 2 + 6
    for line in table[3::3]:
        assert "| T = 0.8 |" in line and "**1.00×** (1.00–1.00) `none`" in line
    assert any(line.startswith("Tree none: no candidate had stream nodes")
               for p in out for line in p.splitlines())
    # the pick's check on every row with streams, and each code row per checkpoint
    picks = next(p for p in out
                 if p.startswith("| model | text | decoding | the pick")).splitlines()
    assert len(picks) == 2 + 4 and all("`1,1`" in line for line in picks[2:])
    per = next(p for p in out
               if p.startswith("| model | text | decoding | checkpoint")).splitlines()
    assert len(per) == 2 + 3 * 2 + 3 and per[2].count(f"`{tiny_ckpt}`") == 1


def test_batch_sweep_json_and_plot(tiny_ckpt, tmp_path):
    """--batch_sweep: one row per batch size, each with its own tree search (the tree none among
    the candidates) and --repeats measured runs, plain decoding at every size after the first
    none, greedy outputs identical to plain decoding at every size, and the figure (where
    matplotlib is installed: the rest runs without it)."""
    plotting = importlib.util.find_spec("matplotlib") is not None
    png = tmp_path / "sweep.png"
    r = run(f"--out_dir={tiny_ckpt}", "--batch_sweep", "--max_batch_size=4", "--num_prompts=3",
            "--max_new_tokens=12", "--prompt_tokens=16", "--batch_candidates=none;1,1;n4",
            "--calibration_tokens=8", "--repeats=2", *[f"--plot={png}"] * plotting, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    rows = doc["batch_sweep"]
    assert [row["batch_size"] for row in rows] == [1, 2, 4] and png.exists() == plotting
    for row in rows:
        assert row["tree"] in ("none", "1,1", "n4") and row["match_rate"] == 1.0
        assert row["rows"] >= 3 and row["ar_latency_s"] > 0 and len(row["speedups"]) == 2
    trees = [row["tree"] for row in rows]
    assert "none" not in trees or set(trees[trees.index("none"):]) == {"none"}
    stop = rows[trees.index("none")]["batch_size"] if "none" in trees else None
    assert doc["stops_paying_at"] == stop
    r = run(f"--out_dir={tiny_ckpt}", "--batch_sweep", "--max_batch_size=2", "--num_prompts=3",
            "--max_new_tokens=12", "--prompt_tokens=16", "--batch_candidates=none", "--repeats=2",
            "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # speculation off: the speculative column is plain decoding's runs
    rows = [(row["tree"], row["speedups"]) for row in doc["batch_sweep"]]
    assert rows == [("none", [1.0, 1.0])] * 2
    assert doc["stops_paying_at"] == 1
    assert ("stops paying at batch size 1 and is off from there on: no tree beat plain decoding"
            in r.stderr)
    r = run(f"--out_dir={tiny_ckpt}", "--batch_size=2", "--num_prompts=3", "--max_new_tokens=12",
            "--prompt_tokens=16", "--tree=1,1", "--repeats=1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["batch_size"] == 2 and doc["match_rate"] == 1.0 and "2 at once" in doc["report"]


def bench_a_batch(tiny_ckpt, capsys):
    """bench.py --batch_size=2 on 3 prompts: (its result, its report's lines)."""
    result = bench.main([f"--out_dir={tiny_ckpt}", "--batch_size=2", "--num_prompts=3",
                         "--max_new_tokens=8", "--prompt_tokens=16", "--tree=1,1", "--repeats=1"])
    return result, capsys.readouterr().out.splitlines()


def test_bench_says_how_many_prompts_a_batch_decodes_and_why(tiny_ckpt, capsys):
    """Too few prompts to fill the queues of a batch are cycled, and the report says so."""
    result, report = bench_a_batch(tiny_ckpt, capsys)
    assert result["prompts"] == 8
    assert ("decoding 8 prompts, not 3: at --batch_size=2 the 3 held-out prompts are cycled to "
            "fill 2 queues of 4 (2 waves of 2 rows each)") in "\n".join(report)
    from ss_mini.lab.tree_choice import batched
    prompts = [[1, 2, 3, 4]] * 40
    assert bench.batch_note(dict(bench.config, batch_size=2), 40, batched(prompts, 2)).startswith(
        "decoding 40 held-out prompts in 2 queues of 20, 2 rows at once")


def test_bench_reports_the_latency_of_a_batch(tiny_ckpt, capsys):
    """At --batch_size=B the report gives the mean time to a full output of both decoders, as
    --batch_sweep does."""
    result, report = bench_a_batch(tiny_ckpt, capsys)
    line = next(line for line in report if line.strip().startswith("latency (s)"))
    assert line.split()[-2:] == [f"{result['ar_latency_s']:.3f}", f"{result['ss_latency_s']:.3f}"]
    assert any("latency: the mean time until a prompt's output is complete" in line
               for line in report)


def test_once_speculation_stops_paying_a_bigger_batch_decodes_plainly():
    """The sweep's candidates at the next batch size: all of them while every run at this size
    paid more than the margin; after a run within it (or the tree `none`, 1.0), only `none`."""
    from ss_mini.lab.batch_sweep import next_candidates
    cands = "none;1,1;1;1,1,1;2,1,1;n8".split(";")
    assert next_candidates(cands, 1.30, 0.02) == cands
    assert next_candidates(cands, 1.01, 0.02) == ["none"]
    assert next_candidates(cands, 0.95, 0.02) == ["none"]
    assert next_candidates(cands, 1.0, 0.02) == ["none"]  # the tree none


def test_calibration_batches_take_turns_as_often_as_single_prompts():
    """The tree search's calibration at B rows: one queue per calibration prompt, each one wave
    of B rows, so the candidates take turns as often as at B = 1; B = 1 is the prompts."""
    from ss_mini.lab.tree_choice import calibration_batches, n_prompts
    cal = [list(range(10 * i, 10 * i + 20)) for i in range(4)]
    assert calibration_batches(cal, 1) == cal
    queues = calibration_batches(cal, 8)
    assert len(queues) == 4 and all(len(q) == 8 for q in queues) and n_prompts(queues) == 32


def test_batches_are_queues_of_two_waves_of_mixed_lengths():
    """bench's batches: two queues (the decoders take turns), each at least two waves of B rows,
    every prompt at least once, cut to different lengths; B = 1 is the prompts themselves."""
    from ss_mini.lab.tree_choice import batched, n_prompts
    prompts = [list(range(10 * i, 10 * i + 20)) for i in range(3)]
    assert batched(prompts, 1) == prompts
    queues = batched(prompts, 4)
    assert len(queues) == 2 and all(len(q) >= 8 for q in queues) and n_prompts(queues) == 16
    rows = [r for q in queues for r in q]
    assert {r[-1] for r in rows} == {19, 29, 39} and len({len(r) for r in rows}) > 1


def test_a_tree_is_named_by_the_spec_that_makes_it():
    """Reports name a tree by its spec, `none` for plain decoding, never Python's None."""
    from ss_mini.lab.measure import tree_spec
    for spec in ("none", "1,1,1", "3,2,1", "n8"):
        assert tree_spec(make_tree(spec, 4)) == spec
