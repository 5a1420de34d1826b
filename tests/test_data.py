"""Datasets and tokenizers."""
import json

import numpy as np
import pytest

from ss_mini.io.data import Tokenizer, load_split, prepare


def test_char_tokenizer_round_trip_and_unknown_characters():
    tok = Tokenizer({"tokenizer": "char", "chars": "\n abcdef"})
    text = "a bad\nface"
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="'xz'"):
        tok.encode("axbz")
    assert tok.empty_prompt() == ([0], repr("\n"))


def test_gpt2_tokenizer_ids():
    tok = Tokenizer({"tokenizer": "gpt2"})
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eot == 50256 and tok.vocab_size == 50257
    text = "def f(x):\n    return x  # ünïcode\n<|endoftext|>"
    assert tok.decode(tok.encode(text)) == text


def test_prepare_text_file(tmp_path):
    path = tmp_path / "story.txt"
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(200)]
    path.write_text("\n".join(lines))
    folder, meta = prepare(f"text:{path}", "char", str(tmp_path / "data"))
    tok = Tokenizer(meta)
    train, val = load_split(folder, "train"), load_split(folder, "val")
    assert tok.decode(np.concatenate([train, val]).tolist()) == path.read_text()
    assert tok.decode(val[:4].tolist()) == "line"  # validation starts at a line break
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15
    # reused, not rebuilt
    again_folder, again = prepare(f"text:{path}", "char", str(tmp_path / "data"))
    assert again == json.load(open(f"{folder}/meta.json")) and again_folder == folder


def test_prepare_python_holds_out_whole_modules(tmp_path):
    folder, meta = prepare("python", "char", str(tmp_path))
    assert meta["val_docs"] and not set(meta["val_docs"]) & set(meta["train_docs"])
    assert len(meta["val_docs"]) * 8 < len(meta["train_docs"])
    tok = Tokenizer(meta)
    val = load_split(folder, "val")
    first = meta["val_docs"][0]
    import sysconfig
    src = open(f"{sysconfig.get_paths()['stdlib']}/{first}", encoding="utf-8",
               errors="replace").read()
    assert tok.decode(val[:200].tolist()) == src[:200]


def test_bad_dataset_messages(tmp_path):
    with pytest.raises(ValueError, match="choose python, shakespeare or text:PATH"):
        prepare("wikipedia", "char", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        prepare(f"text:{tmp_path}/missing.txt", "char", str(tmp_path))
