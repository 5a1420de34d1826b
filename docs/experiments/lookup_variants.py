"""Two variants of the lookup branch against the one built (docs/lookup.md, "Two variants").

    git apply docs/experiments/lookup-variants.patch        # adds both as switches, off
    python docs/experiments/lookup_variants.py out 1+L12 3         # model, tree, runs
    python docs/experiments/lookup_variants.py out 1,1,1+L8 3 0.8  # ... and a temperature
    git apply -R docs/experiments/lookup-variants.patch

In one process, interleaved prompt by prompt: plain decoding, the lookup chain alone, the tree as
built ("today"), with a stream row at the chain's last node ("end": a path that takes the whole
chain drafts its next step from there, not from the root), with the streams' top token of each
depth filling a chain that found nothing ("fill"), and both. Held-out validation prompts, as
`python bench.py` picks them."""
import statistics
import sys

import torch

from ss_mini.extras import make_tree
from ss_mini.io.checkpoint import load_model
from ss_mini.lab.measure import machine, plain, run_interleaved, speculative, summarize
from ss_mini.lab.tree_choice import decode_kwargs, pick_prompts

out_dir, spec, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
model, tok, ckpt = load_model(out_dir, lean=True)
cfg = dict(prompts="", num_prompts=12, prompt_tokens=64, max_new_tokens=256,
           temperature=temperature, top_k=0, top_p=1.0, seed=1337, batch_size=1)
prompts, _ = pick_prompts(cfg, ckpt, tok)
g = model.config.n_drafts


def tree(end=False, fill=False):
    t = make_tree(spec, g)
    t.end_streams, t.fill_empty = end, fill
    return t


names = ["lookup", "today", "end", "fill", "both"]
trees = [make_tree(spec.split("+")[1], g), tree(), tree(end=True), tree(fill=True),
         tree(True, True)]
res = {n: [] for n in names}
for r in range(runs):
    kw = dict(decode_kwargs(cfg, tok), seed=1337 + r)
    ar, *out = run_interleaved(prompts, [plain(model, kw)]
                               + [speculative(model, t, kw) for t in trees])
    for n, o in zip(names, out):
        s = summarize(ar, o)
        res[n].append(s)
        print(r, n, f"speedup {s['speedup']:.3f} tau {s['mean_accepted']:.2f} "
              f"exact {s['match_rate']:.2f}", flush=True)
m = machine("cpu", torch.float32)
print(f"{out_dir} {spec} T={temperature:g} on {m['processor']}, {m['threads']} threads")
for n in names:
    sp = [s["speedup"] for s in res[n]]
    rel = [a["speedup"] / b["speedup"] for a, b in zip(res[n], res["today"])]
    print(f"{n:7s} speedup {statistics.median(sp):.2f}x ({min(sp):.2f}-{max(sp):.2f}), "
          f"tau {statistics.median(s['mean_accepted'] for s in res[n]):.2f}, against today "
          f"{statistics.median(rel):.3f} ({min(rel):.3f}-{max(rel):.3f})")
