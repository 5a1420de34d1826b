"""GPT-2 weights from Hugging Face files, the GPT-2 BPE path, and lossless (frozen-base)
training."""
import os
import subprocess
import sys

import pytest
import torch

from ss_mini.io.checkpoint import is_draft_param, load_model
from ss_mini.baseline import generate_ar
from ss_mini.generate import generate_speculative
from ss_mini.io.pretrained import crop_block_size, load_gpt2
from ss_mini.extras import make_tree

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """A randomly initialised GPT2LMHeadModel saved in both formats (nothing is downloaded)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    st, pt = tmp_path_factory.mktemp("st"), tmp_path_factory.mktemp("pt")
    model.save_pretrained(st, safe_serialization=True)
    model.save_pretrained(pt, safe_serialization=False)
    if not os.path.exists(pt / "pytorch_model.bin"):  # newer transformers always write safetensors
        torch.save(model.state_dict(), pt / "pytorch_model.bin")
        os.remove(pt / "model.safetensors")
    return model, st, pt


@pytest.mark.parametrize("fmt", ["safetensors", "pytorch"])
def test_gpt2_logits_and_greedy_generation_match_transformers(hf_gpt2, fmt):
    hf, st, pt = hf_gpt2
    folder = st if fmt == "safetensors" else pt
    ours = load_gpt2(str(folder), n_streams=3, n_msa_layers=1).eval()
    idx = torch.randint(0, 50257, (2, 40))
    with torch.no_grad():
        ref = hf(idx).logits
    main, _, _ = ours(idx)
    torch.testing.assert_close(main, ref, rtol=0, atol=1e-5)
    prompt = [464, 2068, 7586, 21831]
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                             pad_token_id=50256,
                             attention_mask=torch.ones(1, 4, dtype=torch.long))[0, 4:].tolist()
    ar, _ = generate_ar(ours, prompt, 20)
    ss, _ = generate_speculative(ours, prompt, 20, make_tree("2,1,1", 3))
    assert ar == hf_out == ss


def test_missing_weights_say_where_they_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="looked at"):
        load_gpt2(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
        load_gpt2("surely-not-a-cached-model")


def _run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def test_gpt2_bpe_and_lossless_training(hf_gpt2, tmp_path):
    """gpt2 weights + gpt2 BPE + --freeze_base: the main stream stays the base model's, the
    streams learn."""
    _, st, _ = hf_gpt2
    text = tmp_path / "text.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(400)))
    out = tmp_path / "out"
    r = _run("train.py", f"--out_dir={out}", f"--data_dir={tmp_path / 'data'}",
             f"--dataset=text:{text}", "--tokenizer=gpt2", f"--init_from=gpt2:{st}",
             "--block_size=32", "--batch_size=4", "--max_iters=12", "--eval_interval=12",
             "--eval_iters=2", "--log_interval=4", "--freeze_base=True",
             "--stream_adapter_rank=4", "--n_msa_layers=1", "--learning_rate=1e-2",
             "--warmup_iters=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "lossless mode" in r.stdout and "trainable parameters" in r.stdout
    step = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    first, last = (float(line.split("s1 ")[1].split()[0]) for line in (step[0], step[-1]))
    assert last < first  # stream 1 learned
    trained, tok, _ = load_model(str(out))
    base = load_gpt2(str(st), n_streams=3, n_msa_layers=1, stream_adapter_rank=4)
    crop_block_size(base, 32)
    idx = torch.tensor([tok.encode("def f7(x):\n    return x + 7\n\ndef")])
    with torch.no_grad():
        assert torch.equal(trained(idx)[0], base.eval()(idx)[0])  # bit-identical main stream
        for name, p in trained.named_parameters():
            if not is_draft_param(name):
                assert torch.equal(p, base.state_dict()[name]), name
    r = _run("sample.py", f"--out_dir={out}", "--speculative", "--start=def f3(x):",
             "--max_new_tokens=12")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("def f3(x):") and "tokens per pass" in r.stderr
