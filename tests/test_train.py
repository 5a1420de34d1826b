"""train.py, checkpoints and sample.py, as a user runs them."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from ss_mini.io.checkpoint import load_checkpoint, load_model, param_counts
from ss_mini.masks import tree_mask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=16", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2"]


def run(script, *args, **kw):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args],
                          capture_output=True, text=True, cwd=kw.get("cwd"), timeout=300)


def test_train_end_to_end_resume_and_fine_tune(tmp_path):
    out, data = tmp_path / "out", tmp_path / "data"
    common = [f"--data_dir={data}", *TINY]
    r = run("train.py", f"--out_dir={out}", *common, "--max_iters=6", "--eval_interval=3")
    assert r.returncode == 0, r.stderr
    assert "ms/iter" in r.stdout and "tokens/s" in r.stdout and "min left" in r.stdout
    assert "s1" in r.stdout and "s3" in r.stdout  # per-stream val loss
    ckpt = load_checkpoint(str(out))
    assert ckpt["iter_num"] == 6 and ckpt["tokenizer"]["tokenizer"] == "char"
    assert not any(k.startswith("_orig_mod") for k in ckpt["model"])
    r = run("train.py", f"--out_dir={out}", *common, "--max_iters=9", "--eval_interval=3",
            "--init_from=resume")
    assert r.returncode == 0, r.stderr
    assert "iter 7:" in r.stdout and "iter 1:" not in r.stdout
    assert load_checkpoint(str(out))["iter_num"] == 9
    # a model without streams, then streams added to it by fine-tuning
    plain, ft = tmp_path / "plain", tmp_path / "ft"
    assert run("train.py", f"--out_dir={plain}", *common, "--max_iters=3", "--eval_interval=3",
               "--n_streams=0").returncode == 0
    r = run("train.py", f"--out_dir={ft}", *common, "--max_iters=3", "--eval_interval=3",
            "--n_streams=2", "--n_msa_layers=1", f"--init_from={plain}/ckpt.pt")
    assert r.returncode == 0, r.stderr
    model, _, _ = load_model(str(ft))
    base, _, _ = load_model(str(plain))
    assert model.config.n_streams == 2 and param_counts(model)[1] == 2 * 16
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)  # it trained
    lossless_fine_tune(tmp_path / "lossless", common, plain, base)
    medusa, vocab_size = medusa_fine_tune(tmp_path / "medusa", common, plain, base)
    # the Table-1 style report of all three
    r = run("bench.py", f"--compare={plain},{ft},{medusa}", "--num_prompts=2",
            "--max_new_tokens=16", "--prompt_tokens=8", "--tree=1,1", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row["drafter"] for row in rows] == ["none", "streams (gamma=2, Ns=1)", "Medusa (K=2)"]
    assert rows[1]["draft_params"] == 32
    assert rows[2]["draft_params"] == 2 * (16 * 16 + 16 + 16 * vocab_size)
    assert rows[1]["match_rate"] == rows[2]["match_rate"] == 1.0
    assert all(0.0 <= row["repeat_rate"] <= 1.0 for row in rows)


def lossless_fine_tune(out, common, plain, base):
    """Lossless mode on our own checkpoint: streams and stream adapters learn, the main stream
    stays the base's."""
    r = run("train.py", f"--out_dir={out}", *common, "--max_iters=3", "--eval_interval=3",
            "--n_streams=2", "--n_msa_layers=1", "--stream_adapter_rank=2", "--freeze_base=True",
            f"--init_from={plain}/ckpt.pt")
    assert r.returncode == 0, r.stderr
    trained, tok, _ = load_model(str(out))
    idx = torch.tensor([tok.encode("def main():")])
    # the main stream alone, as generate_ar computes it: bit-identical to the base
    with torch.no_grad():
        main, _ = trained.forward_nodes(idx, torch.arange(idx.shape[1]),
                                        tree_mask(range(-1, idx.shape[1] - 1)), draft_depth=0)
        assert torch.equal(main, base(idx)[0])
        # in a pass that also carries stream rows, matmul shapes differ
        with_streams = trained(idx)[0]
        torch.testing.assert_close(with_streams, main, rtol=0, atol=1e-5)
    adapter = trained.transformer.h[1].attn.stream_adapter.up.weight
    assert not torch.equal(adapter, torch.zeros(48, 2))
    # the main stream's loss cannot move: checkpoints follow the streams' loss
    ckpt = load_checkpoint(str(out))
    assert ckpt["selection_loss"] == pytest.approx(sum(ckpt["val_losses"][1:]) / 2)
    assert "streams' mean val" in r.stdout


def medusa_fine_tune(out, common, plain, base):
    """The Medusa baseline on the frozen base; returns (out, the model's vocabulary size)."""
    r = run("train.py", f"--out_dir={out}", *common, "--max_iters=3", "--eval_interval=3",
            "--n_streams=0", "--n_medusa_heads=2", "--freeze_base=True",
            f"--init_from={plain}/ckpt.pt")
    assert r.returncode == 0, r.stderr
    trained, _, _ = load_model(str(out))
    assert torch.equal(trained.lm_head.weight, base.lm_head.weight)  # frozen base
    # heads trained
    assert not torch.equal(trained.medusa_heads[0].lm_head.weight, base.lm_head.weight)
    return out, trained.config.vocab_size


def test_bad_command_lines(tmp_path):
    r = run("train.py", "--bogus=1")
    assert r.returncode != 0 and r.stderr.strip() == "error: unknown option --bogus; see --help"
    r = run("train.py", "--max_iters=ten")
    assert "takes an integer" in r.stderr
    r = run("train.py", "--help")
    assert r.returncode == 0 and re.search(r"--n_streams +=\s*4\b", r.stdout)
    r = run("sample.py", f"--out_dir={tmp_path}/nothing")
    assert r.returncode != 0 and "run python train.py first" in r.stderr


def test_a_mistyped_flag_is_offered_the_closest_one():
    from ss_mini.io.cli import UsageError, parse_args
    config = dict(max_iters=10, max_new_tokens=5, learning_rate=0.1)
    for typo, hint in (("--max_iter=3", "did you mean --max_iters?"),
                       ("--learningrate", "did you mean --learning_rate?"),
                       ("--bogus=1", "see --help")):
        with pytest.raises(UsageError) as e:
            parse_args(config, [typo])
        assert str(e.value) == f"unknown option {typo.split('=')[0]}; {hint}"


def test_float64_on_mps_is_a_one_line_error():
    """MPS has no float64: --dtype=float64 there is refused before any work, saying what to
    pass (a device string is enough: no MPS is needed)."""
    from ss_mini.io.cli import UsageError, pick_dtype
    for device in ("mps", "mps:0"):
        with pytest.raises(UsageError) as e:
            pick_dtype("float64", device)
        assert str(e.value) == ("--dtype=float64: MPS has no float64; give --dtype=float32 (or "
                                "bfloat16 or float16)")
    assert pick_dtype("float64", "cpu") == "float64" and pick_dtype("auto", "mps") == "float32"


def test_corrupt_checkpoint_is_reported_and_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    r = run("train.py", f"--out_dir={out}", f"--data_dir={tmp_path}/data", *TINY,
            "--init_from=resume")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error:")
    assert "not a readable ss_mini checkpoint" in r.stderr.strip().splitlines()[-1]
    assert (out / "ckpt.pt").read_bytes() == b"not a checkpoint"  # nothing overwritten
    with pytest.raises(FileNotFoundError, match="run python train.py first"):
        load_checkpoint(str(tmp_path / "missing"))


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    from ss_mini.io import checkpoint
    path = tmp_path / "ckpt.pt"
    checkpoint.save_checkpoint({"model": {}, "model_args": {}, "v": 1}, str(path))

    def crash(obj, f):
        open(f, "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint({"model": {}, "model_args": {}, "v": 2}, str(path))
    assert checkpoint.load_checkpoint(str(path))["v"] == 1
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_sample_cli(tiny_ckpt, tmp_path):
    r = run("sample.py", f"--out_dir={tiny_ckpt}", "--start=def ", "--max_new_tokens=40",
            "--speculative", "--num_samples=2", "--tree=2,1,1", "--temperature=0")
    assert r.returncode == 0, r.stderr
    samples = r.stdout.split("\n---------------\n")
    assert len(samples) == 3 and samples[0].startswith("def ") and samples[1].startswith("def ")
    assert "\033[" not in r.stdout  # not a terminal: no colour
    assert r.stderr.count("tokens per pass") == 1 and "2 samples as one batch" in r.stderr
    plain = run("sample.py", f"--out_dir={tiny_ckpt}", "--start=def ", "--max_new_tokens=40",
                "--num_samples=2", "--temperature=0")
    assert plain.stdout == r.stdout  # greedy: the same text with and without speculation
    # the defaults sample (T = 0.8, top-k 200, as nanoGPT): two samples differ from each other
    # and from greedy
    sampled = run("sample.py", f"--out_dir={tiny_ckpt}", "--start=def ", "--max_new_tokens=40",
                  "--num_samples=2")
    assert sampled.returncode == 0, sampled.stderr
    one, two, _ = sampled.stdout.split("\n---------------\n")
    assert one != two and one != samples[0]
    colored = run("sample.py", f"--out_dir={tiny_ckpt}", "--start=def ", "--max_new_tokens=40",
                  "--speculative", "--color=True")
    assert "\033[34m" in colored.stdout
    (tmp_path / "p.txt").write_text("import os\n")
    r = run("sample.py", f"--out_dir={tiny_ckpt}", f"--start=FILE:{tmp_path / 'p.txt'}",
            "--max_new_tokens=5")
    assert r.returncode == 0 and r.stdout.startswith("import os\n")
    r = run("sample.py", f"--out_dir={tiny_ckpt}", "--start=", "--max_new_tokens=5")
    assert r.returncode == 0 and "empty prompt" in r.stderr
    r = run("sample.py", f"--out_dir={tiny_ckpt}", "--start=\u2603\u2602", "--max_new_tokens=5")
    assert r.returncode != 0 and "not in the model's vocabulary" in r.stderr
    assert "\u2603" in r.stderr
    r = run("sample.py", f"--out_dir={tiny_ckpt}", "--start=" + "x = 1\n" * 20,
            "--max_new_tokens=5")
    assert r.returncode == 0 and "keeping its last 24" in r.stderr
    r = run("sample.py", f"--out_dir={tiny_ckpt}", "--speculative", "--tree=1,1,1,1,1,1")
    assert r.returncode != 0 and "streams" in r.stderr


def test_sample_prints_a_character_split_across_passes_whole():
    """A byte-level BPE can end a pass in the middle of a character's UTF-8 bytes: the text waits
    for the rest, and a U+FFFD that the output ends on is printed at the end."""
    from sample import StreamText
    pieces = [b"caf", b"\xc3", b"\xa9 \xe2\x82", b"\xac", b"!\xff"]  # "café €!" and a stray byte
    stream = StreamText(lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8",
                                                                            errors="replace"))
    shown = [stream.add([i]) for i in range(len(pieces))] + [stream.add([], final=True)]
    assert shown == ["caf", "", "é ", "€", "!", "\ufffd"]


def test_sample_speculative_on_plain_model_is_a_clear_error(tmp_path):
    out = tmp_path / "plain"
    assert run("train.py", f"--out_dir={out}", f"--data_dir={tmp_path}/data", *TINY,
               "--max_iters=2", "--eval_interval=2", "--n_streams=0").returncode == 0
    r = run("sample.py", f"--out_dir={out}", "--speculative", "--max_new_tokens=5")
    assert r.returncode != 0 and "n_streams=0" in r.stderr and "without --speculative" in r.stderr


def test_torchrun_two_processes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        "--master_port=29561", os.path.join(ROOT, "train.py"),
                        f"--out_dir={tmp_path}/ddp", f"--data_dir={tmp_path}/data", *TINY,
                        "--max_iters=4", "--eval_interval=2", "--gradient_accumulation_steps=2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 process(es)" in r.stdout and load_checkpoint(f"{tmp_path}/ddp")["iter_num"] == 4


def test_the_documented_torchrun_command_splits_its_steps():
    """train.py's own torchrun line passes the check that each process gets whole accumulation
    steps, and a command that fails it is told the flag that fixes it."""
    import train
    from ss_mini.io.cli import UsageError
    line = next(line for line in train.__doc__.splitlines() if "torchrun" in line)
    world = int(re.search(r"--nproc_per_node=(\d+)", line)[1])
    steps = int(re.search(r"--gradient_accumulation_steps=(\d+)", line)[1])
    assert train.steps_per_process(steps, world) == 1
    with pytest.raises(UsageError) as e:
        train.steps_per_process(1, 2)  # the default on two processes
    assert str(e.value) == ("--gradient_accumulation_steps=1 does not split among 2 processes: "
                            "give --gradient_accumulation_steps=2 (a multiple of the 2 processes)")
    with pytest.raises(UsageError, match="give --gradient_accumulation_steps=6 "):
        train.steps_per_process(5, 3)


def test_bench_json(tiny_ckpt):
    import json
    r = run("bench.py", f"--out_dir={tiny_ckpt}", "--num_prompts=3", "--max_new_tokens=30",
            "--prompt_tokens=20", "--candidates=1,1,1;n4", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("ar_tokens_per_s", "ss_tokens_per_s", "speedup", "mean_accepted",
                "call_reduction", "efficiency", "match_rate", "repeat_rate", "tree", "draft_params",
                "base_params", "device"):
        assert key in doc
    assert doc["match_rate"] == 1.0 and doc["tree"] in ("1,1,1", "n4")
    # the checkpoint's corpus
    assert doc["corpus"]["sha256"] and doc["corpus"]["source"].startswith("Python")
    # (a busy machine adds warnings to stderr)
    report = [line for line in r.stderr.strip().splitlines() if not line.startswith("warning:")]
    # the answer first
    assert report[0].startswith(f"Speculative Streaming speedup {doc['speedup']:.2f}x")
    assert "over 3 runs" in report[0] and doc["lookup_only"]["tree"] == "L4"
    assert any(line.startswith("corpus: Python") and doc["corpus"]["sha256"] in line
               for line in report)


def test_bench_keeps_calibration_prompts_apart(tmp_path, monkeypatch):
    """--prompts=FILE: the first num_prompts // 3 prompts tune the tree, the rest are reported;
    a file with no more than that is used for both (and bench says so)."""
    import json
    import bench
    from ss_mini.lab import tree_choice
    from ss_mini.lab.tree_choice import pick_prompts

    class Tok:
        encode = staticmethod(lambda text: [ord(c) for c in text])

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(7)))
    cfg = dict(bench.config, prompts=str(path), num_prompts=12)
    prompts, calibration = pick_prompts(cfg, None, Tok)
    assert calibration == [Tok.encode(f"prompt {i}") for i in range(4)]
    assert prompts == [Tok.encode(f"prompt {i}") for i in range(4, 7)]
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(3)))
    prompts, calibration = pick_prompts(cfg, None, Tok)
    assert prompts == calibration == [Tok.encode(f"prompt {i}") for i in range(3)]
    # held-out snippets: num_prompts reported, 2 num_prompts // 3 (at least 2) apart to calibrate
    monkeypatch.setattr(tree_choice, "validation_prompts", lambda ckpt, tok, n, length:
                        [[i] for i in range(n)])
    for n, want in ((12, [[1], [4], [6], [9], [11], [14], [16], [19]]), (1, [[0], [2]]),
                    (5, [[1], [4], [7]])):
        prompts, calibration = pick_prompts(dict(cfg, prompts="", num_prompts=n), None, Tok)
        assert calibration == want and len(prompts) == n and not set(map(tuple, prompts)) & set(
            map(tuple, calibration))


def test_tree_search_takes_turns_on_each_prompt(monkeypatch):
    """bench's tree search runs the autoregressive decoder and every candidate on one prompt
    before the next prompt starts (so a burst of load spreads over the candidates), ranks every
    tree against that one baseline and returns the fastest."""
    from conftest import fake_tree_search

    # 3,2,1: more tokens, dearer passes
    timings = {"1,1,1": (3, 1.5), "n4": (2, 1.5), "3,2,1": (4, 3.0)}
    best, rows, calls = fake_tree_search(monkeypatch, timings, n_drafts=3, calibration_tokens=64)
    calls = [(d, p) if tokens == 64 else ("warm-up", p) for d, p, tokens in calls]
    assert best == "1,1,1"  # 24 ms of AR against 12 ms (n4: 18 ms, 3,2,1: 18 ms)
    assert [(spec, n, r["mean_accepted"]) for spec, n, r in rows] == [
        ("1,1,1", 4, 3), ("n4", 4, 2), ("3,2,1", 16, 4)]
    assert calls[:4] == [("warm-up", "p0")] * 4  # every decoder warms up on the first prompt
    calls = calls[4:]
    assert [p for _, p in calls] == ["p0"] * 4 + ["p1"] * 4  # every decoder on p0, then on p1
    assert sorted(d for d, p in calls if p == "p1") == sorted(["ar", "1,1,1", "n4", "3,2,1"])


def test_bench_pass_cost_json(tiny_ckpt):
    import json
    r = run("bench.py", f"--out_dir={tiny_ckpt}", "--pass_cost", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("pass_cost", "pass_cost_floor"):
        assert sorted(doc[key], key=int) == ["1", "4", "8", "16"]
        assert all(v > 0 for v in doc[key].values())



@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_pass_cost_times_the_steps_of_the_sampling_mode_asked(monkeypatch, temperature):
    """`bench.py --pass_cost --temperature=T` (lab/measure.py pass_cost): every speculative step
    it times verifies by speculative sampling when T > 0, and greedily when T = 0."""
    from conftest import random_model
    from ss_mini.lab.measure import pass_cost
    from ss_mini.sampling import Sampler
    sampled, verify = [], Sampler.verify

    def spy(self, main_logits, draft_probs, *args, **kwargs):
        sampled.append(draft_probs is not None)
        return verify(self, main_logits, draft_probs, *args, **kwargs)
    monkeypatch.setattr(Sampler, "verify", spy)
    costs, floors, ar_ms = pass_cost(random_model(seed=1, std=0.4), [1, 2, 3, 4, 5], sizes=(1, 4),
                                     steps=2, warmup=1, temperature=temperature)
    assert sorted(costs) == [1, 4] and all(v > 0 for v in costs.values()) and ar_ms > 0
    assert sampled and set(sampled) == {temperature > 0}

BAD = [  # (script, flags, words the one-line error must contain)
    ("train.py", ["--batch_size=0"], "--batch_size"),
    ("train.py", ["--block_size=0"], "--block_size"),
    ("train.py", ["--block_size=1"], "--block_size"),
    ("train.py", ["--eval_interval=0"], "--eval_interval"),
    ("train.py", ["--gradient_accumulation_steps=0"], "--gradient_accumulation_steps"),
    ("train.py", ["--eval_iters=0"], "--eval_iters"),
    ("train.py", ["--max_iters=0"], "--max_iters"),
    ("train.py", ["--learning_rate=-1"], "--learning_rate"),
    ("train.py", ["--dropout=1"], "--dropout"),
    ("train.py", ["--beta2=1.5"], "--beta2"), ("train.py", ["--min_lr=0.5"], "--min_lr"),
    ("train.py", ["--tokenizer=bpe"], "--tokenizer"),
    ("train.py", ["--init_from=no/such.pt"], "--init_from"),
    ("train.py", ["--n_msa_layers=9"], "n_msa_layers"),
    ("train.py", ["--stream_stride=0"], "--stream_stride"),
    ("train.py", ["--block_size=6", "--stream_stride=3"], "stream_stride"),
    ("train.py", ["--n_embd=10", "--n_head=3"], "divisible"),
    ("train.py", ["--dataset=foo"], "python, shakespeare or text:PATH"),
    ("train.py", ["--init_from=gpt2:no/such/dir", "--tokenizer=gpt2"], "no GPT-2 weights"),
    ("sample.py", ["--temperature=-1"], "--temperature"), ("sample.py", ["--top_p=0"], "--top_p"),
    ("sample.py", ["--top_p=1.5"], "--top_p"), ("sample.py", ["--num_samples=0"], "--num_samples"),
    ("sample.py", ["--max_new_tokens=0"], "--max_new_tokens"),
    ("sample.py", ["--top_k=-1"], "--top_k"),
    ("sample.py", ["--color=maybe"], "--color"),
    ("sample.py", ["--start=FILE:no/such.txt"], "no such file"),
    ("sample.py", ["--speculative", "--tree=250"], "vocabulary"),
    ("sample.py", ["--speculative", "--tree=n100000"], "at most"),
    ("sample.py", ["--speculative", "--tree=x"], "--tree"),
    ("sample.py", ["--speculative", "--tree=0"], "--tree=0: give a top-k of at least 1"),
    ("sample.py", ["--speculative", "--tree=auto"], "bench.py's tree search"),
    ("sample.py", ["--speculative", "--temperature=0.8", "--prune_threshold=0.1"], "greedy only"),
    ("sample.py", ["--speculative", "--prune_threshold=0.1"], "--temperature=0"),
    ("bench.py", ["--num_prompts=0"], "--num_prompts"),
    ("bench.py", ["--prompt_tokens=0"], "--prompt_tokens"),
    ("bench.py", ["--top_p=2"], "--top_p"), ("bench.py", ["--tree=abc"], "--tree"),
    ("bench.py", ["--prompts=no/such.jsonl"], "--prompts"),
    ("bench.py", ["--shape=1,2", "--pass_cost"], "--shape"),
    ("bench.py", ["--repeats=0"], "--repeats"),
    ("bench.py", ["--calibration_tokens=0"], "--calibration_tokens"),
    ("bench.py", ["--tie_margin=-0.1"], "--tie_margin"),
    ("bench.py", ["--tie_margin=1"], "--tie_margin"),
    ("bench.py", ["--suite", "--suite_dirs=out"], "--suite_dirs"),
    ("bench.py", ["--suite"], "does not combine"),
    ("bench.py", ["--batch_size=0"], "--batch_size"),
    ("bench.py", ["--suite", "--batch_size=4"], "does not combine"),
    ("sample.py", ["--speculative", "--trace=t.html", "--num_samples=2"], "--num_samples=1"),
]


@pytest.mark.parametrize("script,flags,words", BAD, ids=[" ".join([s] + f) for s, f, _ in BAD])
def test_bad_input_is_one_clear_line(script, flags, words, tiny_ckpt, tmp_path):
    """Every bad value is refused before any work, with the flag named; nothing is written."""
    import importlib
    from ss_mini.io.cli import UsageError
    main = importlib.import_module(script[:-3]).main
    out = [f"--out_dir={tiny_ckpt}"] if script != "train.py" else [f"--out_dir={tmp_path}/new",
                                                                    f"--data_dir={tmp_path}/data"]
    with pytest.raises((UsageError, ValueError, FileNotFoundError)) as e:
        main(out + flags)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "new").exists() and not (tmp_path / "data").exists()


def test_scripts_print_one_line_errors_and_warn_about_unused_flags(tiny_ckpt):
    r = run("sample.py", f"--out_dir={tiny_ckpt}", "--top_p=0")
    assert r.returncode == 1
    assert r.stderr.strip() == "error: --top_p=0.0: must be in (0.0, 1.0] (see --help)"
    r = run("sample.py", f"--out_dir={tiny_ckpt}", "--max_new_tokens=3", "--tree=3,1",
            "--color=False")
    assert r.returncode == 0 and "--tree has no effect without --speculative" in r.stderr
    assert "--color has no effect" in r.stderr


def test_checkpoints_are_never_lost(tmp_path):
    """A fresh run refuses to replace a checkpoint; a worse model never replaces a better one
    (unless always_save_checkpoint); resume takes data and model from the checkpoint."""
    out, data = tmp_path / "out", tmp_path / "data"
    common = [f"--out_dir={out}", f"--data_dir={data}", *TINY]
    r = run("train.py", *common, "--max_iters=40", "--eval_interval=20", "--learning_rate=3e-3")
    assert r.returncode == 0, r.stderr
    first = (out / "ckpt.pt").read_bytes()
    r = run("train.py", *common, "--max_iters=4")  # a fresh run into the same out_dir
    assert r.returncode == 1 and "--init_from=resume" in r.stderr
    assert "--overwrite=True" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and (out / "ckpt.pt").read_bytes() == first
    r = run("train.py", f"--out_dir={out}", "--init_from=resume", "--n_layer=3", "--max_iters=60")
    assert r.returncode == 1 and "contradicts" in r.stderr
    assert (out / "ckpt.pt").read_bytes() == first
    # resume with nothing but the out_dir: data, tokenizer and model come from the checkpoint; a
    # learning rate far too high makes the model worse, and the better checkpoint stays
    worse = [f"--out_dir={out}", "--init_from=resume", "--max_iters=50", "--eval_interval=10",
             "--learning_rate=0.5", "--warmup_iters=0", "--min_lr=0.5", "--eval_iters=4"]
    r = run("train.py", *worse)
    assert r.returncode == 0, r.stderr
    assert "not saved" in r.stdout and (out / "ckpt.pt").read_bytes() == first
    r = run("train.py", *worse, "--always_save_checkpoint=True")
    assert r.returncode == 0 and "always_save_checkpoint=True" in r.stdout
    ckpt = load_checkpoint(str(out))
    last_val = float(r.stdout.split("step 50:")[1].split("val ")[1].split(" ")[0])
    # the val loss of its own weights
    assert ckpt["iter_num"] == 50 and abs(ckpt["val_loss"] - last_val) < 1e-4


def test_ctrl_c_prints_one_line_and_keeps_the_checkpoint(tmp_path):
    """Ctrl-C in train.py says, in one line, whether it saved the model and how to resume, and
    a checkpoint it does not replace stays as it was; in sample.py it prints one line too."""
    import signal
    out = tmp_path / "out"
    common = [f"--out_dir={out}", f"--data_dir={tmp_path}/data", *TINY]
    assert run("train.py", *common, "--max_iters=4", "--eval_interval=2").returncode == 0
    first = (out / "ckpt.pt").read_bytes()

    def interrupt(args, started):
        # a shell that starts the suite in the background ignores SIGINT, and children inherit
        # that
        p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        for line in p.stdout:  # wait until the work has begun
            if started(line):
                break
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        return p.returncode, err.strip().splitlines()

    code, err = interrupt([os.path.join(ROOT, "train.py"), *common, "--init_from=resume",
                           "--max_iters=100000", "--eval_interval=50000"],
                          lambda line: line.startswith("iter "))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("interrupted: ") and "--init_from=resume" in err[0], err
    saved = re.search(r"checkpoint saved at iter (\d+)", err[0])
    assert saved or "is better; not replaced" in err[0]
    assert (load_checkpoint(str(out))["iter_num"] == int(saved[1]) if saved
            else (out / "ckpt.pt").read_bytes() == first)
    code, err = interrupt([os.path.join(ROOT, "sample.py"), f"--out_dir={out}",
                           "--max_new_tokens=1000000"], lambda line: True)
    assert code == 1 and err[-1] == "interrupted" and not any("Traceback" in e for e in err), err


def test_ctrl_c_in_training_keeps_a_better_model(tmp_path, monkeypatch):
    """Ctrl-C between two evaluations evaluates once more and saves the model if it is better
    than the checkpoint, so the iterations since the last evaluation are not lost; a worse
    model is not saved."""
    import train
    out = tmp_path / "out"
    common = [f"--out_dir={out}", f"--data_dir={tmp_path}/data", *TINY, "--max_iters=1000",
              "--eval_interval=1000"]
    resume = f"; continue with python train.py --init_from=resume --out_dir={out}"
    real = train.get_lr  # the loop calls it first thing in every iteration

    def interrupt_at(k):
        def get_lr(it, cfg):
            if it == k:
                raise KeyboardInterrupt
            return real(it, cfg)
        monkeypatch.setattr(train, "get_lr", get_lr)

    interrupt_at(40)
    with pytest.raises(SystemExit) as e:
        train.main([*common, "--learning_rate=3e-3"])
    ckpt = load_checkpoint(str(out))
    assert ckpt["iter_num"] == 40
    assert e.value.code == (f"\ninterrupted: checkpoint saved at iter 40 "
                            f"(val {ckpt['val_loss']:.4f}){resume}")
    first = (out / "ckpt.pt").read_bytes()
    interrupt_at(50)  # ten iterations at a learning rate far too high: a worse model
    with pytest.raises(SystemExit) as e:
        train.main([*common, "--init_from=resume", "--learning_rate=0.5", "--warmup_iters=0",
                    "--min_lr=0.5"])
    assert e.value.code == (f"\ninterrupted: the saved checkpoint (val {ckpt['val_loss']:.4f}) is "
                            f"better; not replaced{resume}")
    assert (out / "ckpt.pt").read_bytes() == first


def test_training_is_reproducible(tmp_path):
    """The same command and seed on the same machine give bit-identical weights (streams at
    every other position, so the random offset of each batch is drawn too)."""
    common = [f"--data_dir={tmp_path}/data", *TINY, "--stream_stride=2", "--max_iters=8",
              "--eval_interval=4", "--always_save_checkpoint=True"]
    for name in ("a", "b"):
        r = run("train.py", f"--out_dir={tmp_path / name}", *common)
        assert r.returncode == 0, r.stderr
    a, b = load_checkpoint(str(tmp_path / "a")), load_checkpoint(str(tmp_path / "b"))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), \
        [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert a["corpus"] == b["corpus"] and a["corpus"]["sha256"]
    # the test can fail: the seed matters
    r = run("train.py", f"--out_dir={tmp_path / 'c'}", *common, "--seed=7")
    assert r.returncode == 0, r.stderr
    c = load_checkpoint(str(tmp_path / "c"))
    assert not torch.equal(a["model"]["lm_head.weight"], c["model"]["lm_head.weight"])


@pytest.mark.parametrize("script", ["train.py", "sample.py", "bench.py"])
def test_help_says_what_every_option_does(script):
    """--help: every option with its default and one line on what it does (the comment beside
    or above it in the script's config block)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    options = r.stdout.split("options (--key=value, defaults shown):\n", 1)[1].splitlines()
    assert options and all(len(line.split(None, 3)) == 4 for line in options), [
        line for line in options if len(line.split(None, 3)) < 4]
