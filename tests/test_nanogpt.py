"""Importing a nanoGPT checkpoint: exact logits and greedy continuations, a lossless fine-tune
of streams on it, and the refusals (not a checkpoint, wrong meta.pkl, a pickle that is not
plain data, characters outside the vocabulary). Nothing is downloaded: the checkpoints are
written here in the layout of nanoGPT's train.py, and the reference forward below is
nanoGPT's published architecture written out with torch functions."""
import math
import os
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bench
import sample
import train
from ss_mini.io.checkpoint import is_draft_param, load_checkpoint, load_model, model_config
from ss_mini.io.data import Tokenizer, load_split
from ss_mini.baseline import generate_ar
from ss_mini.generate import generate_speculative
from ss_mini.masks import tree_mask
from ss_mini.model import GPT
from ss_mini.io.nanogpt import import_nanogpt, read_meta
from ss_mini.extras import make_tree

TEXT = "".join(f"ROMEO:\nBut soft, what light through yonder window breaks {i}?\n"
               f"JULIET:\nO Romeo, Romeo! wherefore art thou Romeo {i * 7 % 10}?\n\n"
               for i in range(60))


def nanogpt_weights(vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=32, bias=False, std=0.2,
                    seed=0):
    """A state dict under nanoGPT's names, wte and lm_head one tensor as in its tied model."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * std
    C = n_embd
    sd = {"transformer.wte.weight": rnd(vocab_size, C),
          "transformer.wpe.weight": rnd(block_size, C)}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        for name, shape in (("ln_1", (C,)), ("attn.c_attn", (3 * C, C)), ("attn.c_proj", (C, C)),
                            ("ln_2", (C,)), ("mlp.c_fc", (4 * C, C)), ("mlp.c_proj", (C, 4 * C))):
            sd[p + name + ".weight"] = 1 + rnd(*shape) if name.startswith("ln") else rnd(*shape)
            if bias:
                sd[p + name + ".bias"] = rnd(shape[0])
    sd["transformer.ln_f.weight"] = 1 + rnd(C)
    if bias:
        sd["transformer.ln_f.bias"] = rnd(C)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def write_nanogpt(root, sd, n_head=2, bias=False, compiled=False, mask_buffers=False,
                  dataset="shakespeare_char"):
    """root/out-shakespeare-char/ckpt.pt as nanoGPT's train.py saves it (model_args, config,
    AdamW state); compiled: '_orig_mod.' names; mask_buffers: the attn.bias buffers of a torch
    without scaled_dot_product_attention."""
    V, C = sd["transformer.wte.weight"].shape
    T = sd["transformer.wpe.weight"].shape[0]
    n_layer = len({k.split(".")[2] for k in sd if k.startswith("transformer.h.")})
    model = dict(sd)
    if mask_buffers:
        for i in range(n_layer):
            model[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
    if compiled:
        model = {"_orig_mod." + k: v for k, v in model.items()}
    params = [p.clone().requires_grad_() for k, p in sd.items() if k != "lm_head.weight"]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum((p * p).sum() for p in params).backward()
    opt.step()
    args = dict(n_layer=n_layer, n_head=n_head, n_embd=C, block_size=T, bias=bias, vocab_size=V,
                dropout=0.0)
    config = dict(out_dir="out-shakespeare-char", dataset=dataset, batch_size=12, block_size=T,
                  n_layer=n_layer, bias=bias, learning_rate=1e-3, compile=compiled, device="cpu",
                  dtype="float16", decay_lr=True)
    out = root / "out-shakespeare-char"
    out.mkdir(parents=True)
    torch.save({"model": model, "optimizer": opt.state_dict(), "model_args": args, "iter_num": 250,
                "best_val_loss": torch.tensor(1.5), "config": config}, out / "ckpt.pt")
    return out


def write_meta(folder, text):
    """data/<dataset>/meta.pkl and input.txt as nanoGPT's data/shakespeare_char/prepare.py writes
    them."""
    folder.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi, itos = {ch: i for i, ch in enumerate(chars)}, {i: ch for i, ch in enumerate(chars)}
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    (folder / "input.txt").write_text(text)
    return stoi


def reference_logits(sd, n_head, idx):
    """nanoGPT's forward in eval mode, from its published architecture: token + position
    embeddings; per block x + attn(LN(x)) then x + mlp(LN(x)), LayerNorm eps 1e-5; causal
    attention scaled by 1/sqrt(head size); MLP 4x wide with the exact (erf) GELU; a final
    LayerNorm; the head is the token embedding matrix."""
    B, T = idx.shape
    C = sd["transformer.wte.weight"].shape[1]
    hs = C // n_head
    ln = lambda x, p: F.layer_norm(x, (C,), sd[p + ".weight"], sd.get(p + ".bias"), eps=1e-5)
    lin = lambda x, p: x @ sd[p + ".weight"].T + (sd[p + ".bias"] if p + ".bias" in sd else 0)
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    i = 0
    while f"transformer.h.{i}.ln_1.weight" in sd:
        p = f"transformer.h.{i}."
        q, k, v = lin(ln(x, p + "ln_1"), p + "attn.c_attn").split(C, dim=-1)
        q, k, v = (t.reshape(B, T, n_head, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1) / math.sqrt(hs)).masked_fill(future, float("-inf"))
        att = att.softmax(-1)
        x = x + lin((att @ v).transpose(1, 2).reshape(B, T, C), p + "attn.c_proj")
        h = lin(ln(x, p + "ln_2"), p + "mlp.c_fc")
        x = x + lin(0.5 * h * (1 + torch.erf(h / math.sqrt(2))), p + "mlp.c_proj")
        i += 1
    return ln(x, "transformer.ln_f") @ sd["lm_head.weight"].T


def reference_greedy(sd, n_head, prompt, n):
    """The naive greedy loop: the whole sequence through the model for every token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference_logits(sd, n_head, torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def imported_model(source, **streams):
    """The imported model as train.py builds it: nanoGPT's weights, fresh streams."""
    model = GPT(model_config({**source["model_args"], **streams}))
    missing, unexpected = model.load_state_dict(source["model"], strict=False)
    assert not unexpected and all(is_draft_param(k) for k in missing)
    return model.eval()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mask_buffers", [False, True])
def test_logits_equal_nanogpts(tmp_path, bias, compiled, mask_buffers):
    stoi = write_meta(tmp_path / "data" / "shakespeare_char", TEXT)
    sd = nanogpt_weights(len(stoi), bias=bias)
    out = write_nanogpt(tmp_path, sd, bias=bias, compiled=compiled, mask_buffers=mask_buffers)
    source = import_nanogpt(str(out))  # meta.pkl found in nanoGPT's data/<dataset>/, beside out_dir
    assert source["tokenizer"] == {"tokenizer": "char", "chars": "".join(sorted(set(TEXT)))}
    assert source["meta_pkl"] == str(tmp_path / "data" / "shakespeare_char" / "meta.pkl")
    model = imported_model(source)
    idx = torch.randint(0, len(stoi), (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference_logits(sd, 2, idx)
        torch.testing.assert_close(model(idx)[0], ref, rtol=0, atol=1e-5)
        tanh = imported_model({**source, "model_args": {**source["model_args"],
                                                        "gelu_approximate": "tanh"}})
        # GPT-2's GELU is not nanoGPT's: the field matters
        assert (tanh(idx)[0] - ref).abs().max() > 1e-4
        # as nanoGPT's train.py crops
        cropped = imported_model(import_nanogpt(str(out), block_size=16))
        assert cropped.config.block_size == 16 and cropped.transformer.wpe.weight.shape[0] == 16
        torch.testing.assert_close(cropped(idx[:, :16])[0], ref[:, :16], rtol=0, atol=1e-5)


def test_greedy_continuation_equals_the_reference_loop(tmp_path):
    stoi = write_meta(tmp_path / "data" / "shakespeare_char", TEXT)
    sd = nanogpt_weights(len(stoi), bias=True, std=0.3, seed=3)
    source = import_nanogpt(str(write_nanogpt(tmp_path, sd, bias=True)))
    # float64 on both sides: no near-tie of two logits can then tell two exact implementations apart
    model = imported_model(source, n_streams=3, n_msa_layers=1).double()
    sd64 = {k: v.double() for k, v in sd.items()}
    prompt = [stoi[c] for c in "ROMEO:\n"]
    # the whole block: no sliding window yet
    want = reference_greedy(sd64, 2, prompt, 32 - len(prompt))
    ar, _ = generate_ar(model, prompt, len(want))
    ss, _ = generate_speculative(model, prompt, len(want), make_tree("2,1,1", 3))
    assert ar == want and ss == want
    assert len(set(want)) > 3  # a continuation, not one token repeated


def test_lossless_fine_tune_then_sample_and_bench(tmp_path, capsys):
    """The issue's three commands on a nanoGPT layout: train.py imports, encodes the text with
    nanoGPT's ids, trains only the streams; sample.py and bench.py take the result."""
    data = tmp_path / "nanoGPT" / "data" / "shakespeare_char"
    stoi = write_meta(data, TEXT)
    sd = nanogpt_weights(len(stoi), bias=False, std=0.3)
    nano = write_nanogpt(tmp_path / "nanoGPT", sd, compiled=True)
    out, ours = tmp_path / "out-from-nanogpt", tmp_path / "data"
    common = [f"--init_from=nanogpt:{nano}", f"--dataset=text:{data / 'input.txt'}",
              f"--data_dir={ours}", "--batch_size=4", "--eval_interval=3", "--eval_iters=1",
              "--log_interval=100", "--warmup_iters=1"]
    train.main(common + [f"--out_dir={out}", "--freeze_base=True", "--n_streams=3",
                         "--stream_adapter_rank=8", "--max_iters=6", "--learning_rate=1e-2"])
    ckpt = load_checkpoint(str(out))
    assert ckpt["config"]["meta_pkl"] == str(data / "meta.pkl")
    assert ckpt["corpus"]["train_tokens"] > 0
    folder = os.path.join(ours, os.listdir(ours)[0])
    # not the folder of a vocabulary built from the text
    assert len(os.listdir(ours)) == 1 and "-vocab-" in folder
    ids = np.concatenate([load_split(folder, "train"), load_split(folder, "val")])
    assert ids.tolist() == [stoi[c] for c in TEXT]  # nanoGPT's ids
    trained, tok, _ = load_model(str(out))
    base = imported_model(import_nanogpt(str(nano)))
    for name, p in trained.named_parameters():
        if not is_draft_param(name):
            assert torch.equal(p, base.state_dict()[name]), name
    # the streams trained
    assert trained.transformer.h[1].attn.stream_adapter.up.weight.abs().sum() > 0
    idx = torch.tensor([tok.encode(TEXT[:30])])
    # the main stream alone, as generate_ar computes it: bit-identical to nanoGPT's model
    with torch.no_grad():
        main, _ = trained.forward_nodes(idx, torch.arange(30), tree_mask(range(-1, 29)),
                                        draft_depth=0)
        assert torch.equal(main, base(idx)[0])
        torch.testing.assert_close(main, reference_logits(sd, 2, idx), rtol=0, atol=1e-5)
    capsys.readouterr()
    sample.main([f"--out_dir={out}", "--start=ROMEO:", "--max_new_tokens=20", "--temperature=0"])
    sample.main([f"--out_dir={out}", "--speculative", "--start=ROMEO:", "--max_new_tokens=20",
                 "--temperature=0"])
    ar_text, ss_text = capsys.readouterr().out.split("\n---------------\n")[:2]
    assert ar_text == ss_text and ar_text.startswith("ROMEO:") and len(ar_text) == 26
    result = bench.main([f"--out_dir={out}", "--num_prompts=2", "--prompt_tokens=8",
                         "--max_new_tokens=8", "--tree=1,1", "--json"])
    # bench read the same tokenised text
    assert result["match_rate"] == 1.0 and len(os.listdir(ours)) == 1
    # without --freeze_base everything trains
    full = tmp_path / "full"
    train.main(common + [f"--out_dir={full}", "--n_streams=3", "--max_iters=2"])
    model, _, _ = load_model(str(full))
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)


def test_gpt2_bpe_when_there_is_no_meta_pkl(tmp_path):
    sd = nanogpt_weights(50304, n_layer=1, n_embd=8, block_size=8)
    source = import_nanogpt(str(write_nanogpt(tmp_path, sd, dataset="openwebtext") / "ckpt.pt"))
    assert source["tokenizer"] == {"tokenizer": "gpt2"} and source["meta_pkl"] == ""
    small = tmp_path / "small"
    write_nanogpt(small, nanogpt_weights(65), dataset="shakespeare_char")
    # 65 tokens: a char model, its meta.pkl lost
    with pytest.raises(FileNotFoundError, match="give --meta_pkl=PATH"):
        import_nanogpt(str(small / "out-shakespeare-char"))


class Shell:
    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def one_line_error(argv, match):
    with pytest.raises((ValueError, RuntimeError, FileNotFoundError), match=match) as e:
        train.main(argv)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_inputs_are_one_line_errors_and_touch_nothing(tmp_path):
    root = tmp_path / "nanoGPT"
    data = root / "data" / "shakespeare_char"
    write_meta(data, TEXT)
    nano = write_nanogpt(root, nanogpt_weights(len(set(TEXT))))
    out, ours = tmp_path / "out", tmp_path / "ours"
    base = [f"--out_dir={out}", f"--data_dir={ours}", f"--dataset=text:{data / 'input.txt'}",
            "--max_iters=2"]
    one_line_error(base + [f"--init_from=nanogpt:{tmp_path / 'nowhere'}"], "no file")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    one_line_error(base + [f"--init_from=nanogpt:{tmp_path / 'notes.txt'}"],
                   "not a checkpoint that torch.load")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    one_line_error(base + [f"--init_from=nanogpt:{tmp_path / 'other.pt'}"],
                   "not a nanoGPT checkpoint")
    fork = dict(torch.load(nano / "ckpt.pt", weights_only=True))
    fork["model_args"] = {**fork["model_args"], "use_rmsnorm": True}
    torch.save(fork, tmp_path / "fork.pt")
    one_line_error(base + [f"--init_from=nanogpt:{tmp_path / 'fork.pt'}"], "a modified nanoGPT")
    fork = dict(torch.load(nano / "ckpt.pt", weights_only=True))
    fork["model"] = {**fork["model"], "lm_head.weight": fork["model"]["lm_head.weight"] + 1}
    torch.save(fork, tmp_path / "untied.pt")
    one_line_error(base + [f"--init_from=nanogpt:{tmp_path / 'untied.pt'}"],
                   "lm_head and wte differ")
    # a nanoGPT checkpoint where an ss_mini one is expected says how to import it
    one_line_error(base + [f"--init_from={nano / 'ckpt.pt'}"], "--init_from=nanogpt:")
    with pytest.raises(RuntimeError, match="is a nanoGPT checkpoint: add streams"):
        sample.main([f"--out_dir={nano}"])
    # meta.pkl: another vocabulary size; not plain data; code to run
    with open(tmp_path / "other.pkl", "wb") as f:
        pickle.dump({"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "c"},
                     "stoi": {"a": 0, "b": 1, "c": 2}}, f)
    one_line_error(base + [f"--init_from=nanogpt:{nano}", f"--meta_pkl={tmp_path / 'other.pkl'}"],
                   "has 3 characters but .* a vocabulary of")
    with open(tmp_path / "floats.pkl", "wb") as f:
        pickle.dump({"vocab_size": 2, "itos": {0: "a", 1: "b"}, "scale": 0.5}, f)
    one_line_error(base + [f"--init_from=nanogpt:{nano}", f"--meta_pkl={tmp_path / 'floats.pkl'}"],
                   "other things than dicts, lists, strings and ints")
    shell = Shell()
    shell.path = tmp_path / "pwned"
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump({"vocab_size": 1, "itos": {0: "a"}, "x": shell}, f)
    one_line_error(base + [f"--init_from=nanogpt:{nano}", f"--meta_pkl={tmp_path / 'evil.pkl'}"],
                   "names .*system")
    with pytest.raises(ValueError, match="not plain data"):
        read_meta(tmp_path / "evil.pkl")
    assert not (tmp_path / "pwned").exists()
    # a text with characters nanoGPT's vocabulary lacks
    (tmp_path / "other.txt").write_text(TEXT + "Ω and ~\n" * 20)
    msg = one_line_error([f"--out_dir={out}", f"--data_dir={ours}",
                          f"--dataset=text:{tmp_path / 'other.txt'}",
                          f"--init_from=nanogpt:{nano}"], "outside the model's vocabulary")
    assert "'~Ω'" in msg
    assert not out.exists() and not ours.exists() and not (tmp_path / "pwned").exists()
    assert Tokenizer({"tokenizer": "char", "chars": read_meta(data / "meta.pkl")}).encode("ROMEO:")
