"""A trace of Speculative Streaming decoding: what every pass drafted, verified and accepted.

generate_speculative(..., observe=trace.observe) hands each pass to `Trace.observe`, which
turns it into plain data (token ids, texts, parents, probabilities); nothing is recorded
without it. `Trace.save` writes the data as JSON, or as one self-contained HTML page
(trace_page.html: vanilla JS draws the text, each pass's tree and attention mask, and a
summary from the JSON embedded in the page; no network, scripts, styles or fonts from
outside). sample.py --speculative --trace=FILE.html is the way in.

Per pass: the cache length L, the root, the drafted tree (every node's token, depth, parent,
rank, who proposed it (the streams or the decoded text), the draft probability of its token,
the token the main stream emitted there, and its status: root, accepted, rejected,
unreached or pruned), the accepted path, the next root, how many tokens it emitted (its
accepted drafts and the next root), and the attention mask of its multi-stream layers (after
pruning, when it pruned) in sparse form: for each row, the key columns it may attend to, the
cached prefix collapsed to column 0, then the nodes, then the streams.
"""
import json
import os
import re
import tempfile

import torch

from .shapes import host_shape

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_page.html")
EXTENSIONS = (".html", ".json")


def check_path(path):
    """A trace file that can be written: .html or .json, in a folder that exists. Raises a
    one-line ValueError otherwise, before any decoding."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ValueError(f"--trace={path}: give a file name ending in .html (a page to open in a "
                         "browser) or .json")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--trace={path}: the folder {folder} does not exist; create it or pick "
                         "another path")
    if os.path.isdir(path):
        raise ValueError(f"--trace={path} is a folder: give a file name ending in .html or .json")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--trace={path}: the folder {folder} is not writable")


def kept_nodes(drafted, verified):
    """The drafted index of each node of the verified shape (pruning keeps a subset): a node is
    named by the ranks along its path from the root, the same in both shapes."""
    def rank_paths(shape):
        paths = []
        for u in range(shape.n_nodes):
            paths.append(paths[shape.parents[u]] + (shape.ranks[u],) if u else ())
        return paths
    index = {p: u for u, p in enumerate(rank_paths(drafted))}
    return [index[p] for p in rank_paths(verified)]


def sources(shape):
    """Who proposed each node: 'streams', or 'text' for a draft from the decoded text
    (extras/lookup.py); the root: None."""
    return [None] + ["streams" if r >= 0 else "text" for r in shape.ranks[1:]]


def sparse_mask(mask, L):
    """A pass's mask (rows, L + keys), additive (0 = may attend) or bool, as the visible key
    columns of each row: column 0 is the cached prefix (all L tokens or none), 1.. the rest."""
    see = mask == 0 if mask.dtype != torch.bool else mask
    prefix, rest = see[:, :L], see[:, L:]
    if L and not torch.equal(prefix.all(1), prefix.any(1)):
        raise ValueError("a row sees part of the cached prefix: the prefix cannot be collapsed to "
                         "one column")
    rows = []
    for r, keys in enumerate(rest.tolist()):
        rows.append(([0] if L and bool(prefix[r, 0]) else [])
                    + [k + 1 for k, v in enumerate(keys) if v])
    return rows


def dense_mask(rows, L, n_keys):
    """The bool mask (rows, L + n_keys) that `sparse_mask` describes (tests compare it)."""
    out = torch.zeros(len(rows), L + n_keys, dtype=torch.bool)
    for r, cols in enumerate(rows):
        for c in cols:
            if c == 0:
                out[r, :L] = True
            else:
                out[r, L + c - 1] = True
    return out


def record(step, decode):
    """Plain data from one pass (`pass_data`); `decode` turns token ids into text."""
    drafted, shape, L = step["drafted_shape"], step["shape"], step["cache_length"]
    tokens = step["drafted_tokens"].tolist()
    kept = kept_nodes(drafted, shape)
    # the probability of each node's token under the draft distribution it came from: q after
    # temperature, top-k and top-p when sampling, softmax(q) when greedy (the drafts are its top-k)
    probs = step["draft_probs"]
    if probs is None:
        probs = torch.softmax(step["draft_logits"].float(), dim=-1)
    # drafts from the text (rank -1, extras/lookup.py) have no q: a point mass
    q_prob = [None] + [probs[d - 1, t].item() if r >= 0 else None
                       for d, t, r in zip(drafted.depths[1:], tokens[1:], drafted.ranks[1:])]
    source = sources(drafted)
    emitted = [None] * drafted.n_nodes
    for i, u in enumerate(kept):
        emitted[u] = step["ys"][i]
    path = [kept[i] for i in step["path"]]
    on_path, alive = set(path), set(kept)
    nodes = []
    for u in range(drafted.n_nodes):
        p = drafted.parents[u]
        # rejected: the main stream emitted another token at its parent; unreached: a child of
        # the path that carries the token emitted there and was not accepted lies past the
        # block's end (a fixed shape keeps such nodes, a pass never accepts them)
        status = ("root" if u == 0 else "accepted" if u in on_path else "pruned" if u not in alive
                  else "rejected" if p in on_path and tokens[u] != emitted[p] else "unreached")
        nodes.append(dict(token=tokens[u], text=decode([tokens[u]]), depth=drafted.depths[u],
                          parent=p, rank=drafted.ranks[u], source=source[u], q_prob=q_prob[u],
                          emitted=emitted[u],
                          emitted_text=None if emitted[u] is None else decode([emitted[u]]),
                          status=status))
    g = step["draft_depth"]
    mask = shape.mask(L)
    if mask.shape[0] != shape.n_nodes + len(shape.streams) * g:
        raise RuntimeError(f"a mask of {mask.shape[0]} rows for {shape.n_nodes} nodes, "
                           f"{len(shape.streams)} of them with {g} streams")
    return dict(cache_length=L, root=tokens[0], nodes=nodes, path=path, next_root=step["next_root"],
                next_root_text=decode([step["next_root"]]), accepted=len(path), kept=kept,
                pruned=[u for u in range(drafted.n_nodes) if u not in alive], n_streams=g,
                carriers=shape.streams,
                mask=sparse_mask(mask, L), mask_keys=mask.shape[1] - L)


def summary(passes):
    """Passes, tau (tokens emitted per pass: accepted drafts + 1, as Stats.mean_accepted), the
    histogram of tokens per pass, and the acceptance rate by depth d: of the passes whose path
    reached depth d - 1 at a node with a verified child, the share that accepted a child there;
    the accepted drafts by who proposed them (`sources`)."""
    lengths = [p["emitted"] for p in passes]
    hist = {}
    for a in lengths:
        hist[a] = hist.get(a, 0) + 1
    tried, reached, by_source = {}, {}, {}
    for p in passes:
        nodes, path = p["nodes"], p["path"]
        for u in path[1:]:
            by_source[nodes[u]["source"]] = by_source.get(nodes[u]["source"], 0) + 1
        for d, u in enumerate(path, 1):  # u is at depth d - 1
            # a child that could be accepted: not pruned, not past the block's end (unreached)
            if any(n["parent"] == u and n["status"] in ("accepted", "rejected") for n in nodes):
                tried[d] = tried.get(d, 0) + 1
                reached[d] = reached.get(d, 0) + (d < len(path))
    return dict(passes=len(passes), tau=sum(lengths) / len(lengths) if lengths else 0.0,
                nodes_per_pass=sum(len(p["kept"]) for p in passes) / len(passes) if passes else 0.0,
                histogram=[[k, hist[k]] for k in sorted(hist)],
                acceptance_by_depth=[[d, reached[d], tried[d]] for d in sorted(tried)],
                accepted_by_source=by_source)


def pass_data(cache, drafted, ran, verified, step):
    """What speculative_step's observer gets (step.py), as plain data of the batch's first row:
    the tree drafted and the tree the pass ran (fewer nodes when pruned)."""
    a = int(step.n_emitted[0])
    last = int(verified.last[0]) - int(ran.shape.first_node[0])
    return dict(cache_length=int(cache.length[0]) - a, draft_logits=drafted.logits[0],
                draft_probs=None if drafted.probs is None else drafted.probs[0],
                drafted_tokens=drafted.tokens[0], drafted_shape=host_shape(drafted.shape),
                tokens=ran.tokens[0].tolist(), shape=host_shape(ran.shape),
                ys=verified.targets[0].tolist(), path=ran.shape.path[0, last][:a].tolist(),
                next_root=int(step.root[0]), draft_depth=drafted.logits.shape[1])


class Trace:
    """Records the passes of one generate_speculative call: pass `observe` to it, then
    `finish`."""

    def __init__(self, decode, eot=None, **settings):
        self.decode, self.eot, self.settings = decode, eot, settings
        self.passes, self.data = [], None

    def observe(self, cache, drafted, ran, verified, step):
        self.passes.append(record(pass_data(cache, drafted, ran, verified, step), self.decode))

    def finish(self, prompt, output):
        """The trace's data: settings, prompt, output (token ids, and its text in chunks: the
        prefill's token, then the tokens each pass emitted: its accepted drafts and the next
        root), passes and summary. A pass's `emitted` counts its tokens up to where the output
        ends (max_new_tokens, or end-of-text, which counts but is not output), as Stats does."""
        output = list(output)
        stream = output[:1] + [t for p in self.passes for t in
                               [p["nodes"][u]["token"] for u in p["path"][1:]] + [p["next_root"]]]
        end = len(output) + (len(stream) > len(output) and self.eot is not None
                             and stream[len(output)] == self.eot)
        chunks = [{"pass": None, "text": self.decode(output[:1])}] if output else []
        start = 1
        for k, p in enumerate(self.passes):
            p["emitted"] = max(0, min(p["accepted"], end - start))
            if start < len(output):
                chunks.append({"pass": k, "text": self.decode(output[start:start + p["accepted"]])})
            start += p["accepted"]
        self.data = dict(version=2, settings=self.settings, prompt=self.decode(list(prompt)),
                         output=output, chunks=chunks, passes=self.passes,
                         summary=summary(self.passes))
        return self.data

    def save(self, path):
        """Write the data as JSON or as the HTML page (by the extension), atomically."""
        check_path(path)
        text = json.dumps(self.data) if path.lower().endswith(".json") else to_html(self.data)
        write_atomic(path, text)


def to_html(data):
    """The page with the data embedded. Inside the script block '<' is escaped (so the text
    cannot close it) and so is the colon of any URL scheme in the text (the page refers to
    nothing outside itself); both stay the same characters for JSON.parse."""
    blob = json.dumps(data).replace("<", "\\u003c")
    blob = re.sub(r"(?i)(https?):", lambda m: m.group(1) + "\\u003a", blob)
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    return page.replace("/*TRACE_DATA*/null", blob, 1)


def write_atomic(path, text):
    """Write a temp file in the target's folder, then os.replace: an existing file is replaced
    whole or not at all."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".trace-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
