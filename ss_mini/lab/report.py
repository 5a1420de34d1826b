"""The Markdown that `python bench.py --suite` prints: the README's results table and its
worked example, rendered from the suite's JSON document, so that the two never disagree.
The metrics are defined in measure.py."""
from ..io.data import describe_fingerprint

SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789@%+=:,./-_")


def shell_quote(text):
    """text as one word of a bash command line: bare when it is safe, '...' when it is
    printable without quotes, else $'...' with escapes (newlines, tabs, form feeds)."""
    if text and set(text) <= SAFE:
        return text
    if "'" not in text and all(c.isprintable() for c in text):
        return f"'{text}'"
    escape = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t"}
    return "$'" + "".join(escape.get(c, c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256
                                     else f"\\u{ord(c):04x}") for c in text) + "'"


def side_by_side(columns, width=40, lines=3):
    """[(title, text), ...] as columns of the first `lines` lines of each text, cut to `width`;
    a line of nothing but spaces says how many, since a blank column would hide them."""
    cells = []
    for title, text in columns:
        rows = ["".join(c if c.isprintable() else "?" for c in row)
                for row in text.expandtabs(4).split("\n")[:lines]]
        rows = [f"({len(row)} spaces)" if row and not row.strip(" ") else row for row in rows]
        cells.append([title, "-" * width]
                     + [row if len(row) <= width else row[:width - 1] + "…" for row in rows])
    depth = max(len(c) for c in cells)
    cells = [c + [""] * (depth - len(c)) for c in cells]
    return [" | ".join(f"{c[i]:<{width}}" for c in cells).rstrip() for i in range(depth)]


def speedup_cell(x, lo, hi, bold=True):
    mark = "**" if bold else ""
    return f"{mark}{x:.2f}×{mark} ({lo:.2f}–{hi:.2f})"


def suite_markdown(doc):
    return "\n".join(table_markdown(doc) + checkpoints_markdown(doc)
                     + example_markdown(doc["worked_example"]))


def text_of(row):
    return "held-out" if row["prompts"] == "held-out" else f"never seen (`{row['prompts']}`)"


def table_markdown(doc):
    """The results table's lines: the machine, one row per SUITE row over its checkpoints, the
    notes under it, and whether the search's pick carries to the measured prompts."""
    m, rows = doc["machine"], doc["rows"]
    threads = f"{m['threads']} thread" + "s" * (m["threads"] != 1)
    seeds = max(len(r["checkpoints"]) for r in rows)
    out = [f"`python bench.py --suite` on {m['processor']} ({m['device']}), {threads}, torch "
           f"{m['torch']}, {m['dtype']}: {doc['max_new_tokens']} new tokens per prompt, "
           f"{doc['repeats']} runs of each row on each of {seeds} checkpoint"
           f"{'s' * (seeds != 1)} per model; a speedup is the median checkpoint's median run, "
           "the range in brackets spans every checkpoint and run (sampled rows draw with seeds "
           "--seed, --seed + 1, ...); the rows take turns run by run.", "",
           "| model | text | decoding | plain tokens/s | prompt lookup | streams | streams + "
           "lookup | **Speculative Streaming** (the pick) | τ | output repeats |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        text = text_of(r)
        kinds = [r["kinds"].get(k) for k in ("prompt lookup", "streams", "streams + lookup")]
        cells = [speedup_cell(k["speedup"], *k["speedup_range"], bold=False)
                 + f" `{'`, `'.join(sorted(set(k['trees'])))}`" if k else "–" for k in kinds]
        ar = [s["ar_tokens_per_s"] for s in r["seeds"]]
        rep = r["repeat_rates"]
        out.append(f"| {r['dataset']} | {text} | {r['decoding']} | "
                   f"{sorted(ar)[(len(ar) - 1) // 2]:,.0f} | {' | '.join(cells)} | "
                   f"{speedup_cell(r['speedup'], *r['speedup_range'])} "
                   f"`{'`, `'.join(r['trees'])}` | {r['mean_accepted']:.2f} | "
                   f"{min(rep):.0%}–{max(rep):.0%} |")
    out += ["", "Each cell: the speedup over plain decoding and the trees (one per checkpoint; "
            "the pick: the tree search's on calibration prompts kept apart from the reported ones, "
            "among the trees with stream nodes; the other columns: the fastest tree of that kind "
            "in the same search). τ: the pick's tokens per pass (accepted drafts + 1); output "
            "repeats: the share of plain decoding's 12-grams that occurred earlier in its output, "
            "over the checkpoints. Prompt lookup drafts a repeated span whole, so where the "
            "output repeats it leads, and the figures of streams + lookup follow the repeat rate "
            "(definitions: `ss_mini/lab/measure.py`)."]
    if any("none" in r["trees"] for r in rows):
        out.append("Tree none: no candidate had stream nodes, so the row decodes plainly (1.00×: "
                   "the same runs in both columns).")
    greedy = [r["match_rate"] for r in rows if r["temperature"] == 0]
    if greedy:
        out.append(f"Greedy outputs identical to autoregressive decoding on {min(greedy):.0%} of "
                   "prompts" + (" in every run." if min(greedy) == 1 else " in the worst run."))
    checks = [r for r in rows if r.get("pick_check") and r["pick_check"]["speedup"]]
    if checks:
        n = max(len(r["pick_check"]["speedups"]) for r in checks)
        runs = checks[0]["pick_check"].get("runs", 1)
        out += ["", f"Does the pick carry? Each of the {n} candidates with stream nodes on the "
                "measured prompts of the first checkpoint, "
                + ("one run each (the best of single runs is lifted by their noise):" if runs == 1
                   else f"the median of {runs} runs each:"), "",
                "| model | text | decoding | the pick there | the best there |",
                "|---|---|---|---|---|"]
        for r in checks:
            c = r["pick_check"]
            out.append(f"| {r['dataset']} | {text_of(r)} | {r['decoding']} | `{c['tree']}` "
                       f"{c['speedup']:.2f}× ({c['speedup'] / c['best_speedup']:.0%} of the best) "
                       f"| `{c['best_tree']}` {c['best_speedup']:.2f}× |")
    out += ["", *[f"`{c['checkpoint']}` was trained on: {describe_fingerprint(c['corpus'])}."
                  for c in doc["checkpoints"][:1]]]
    return out


def checkpoints_markdown(doc):
    """Each row's figures per checkpoint (the pick's), when a model has more than one."""
    if max(len(r["seeds"]) for r in doc["rows"]) < 2:
        return []
    out = ["", "Per checkpoint (the pick's median run; the range over its runs):", "",
           "| model | text | decoding | checkpoint | tree | plain tokens/s | speedup | τ | "
           "output repeats |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        for s in r["seeds"]:
            out.append(f"| {r['dataset']} | {text_of(r)} | {r['decoding']} | `{s['checkpoint']}` "
                       f"| `{s['tree']}` | {s['ar_tokens_per_s']:,.0f} | "
                       f"{speedup_cell(s['speedup'], *s['speedup_range'], bold=False)} | "
                       f"{s['tau']:.2f} | {s['repeat_rate']:.0%} |")
    return out


def example_markdown(ex):
    """The worked example's lines: the prompt, greedy against sampled, and the commands."""
    g, s = ex["greedy"], ex["sampled"]
    return ["", "### Worked example", "",
            f"The held-out prompt of the first row whose greedy τ is the median of its "
            f"{ex['n_prompts']} (prompt {ex['prompt_index']}; the lower middle for an even count, "
            "ties to the earlier prompt): a rule picks it, so it is representative rather than "
            "chosen by hand, and it changes when the model does. The prompt ends:",
            "", "```", *ex["prompt"].expandtabs(4).split("\n")[-3:], "```", "",
            f"| | greedy | T = {s['temperature']:g} |", "|---|---|---|",
            f"| tree | {g['tree']} | {s['tree']} |",
            f"| τ (tokens per pass) | {g['tau']:.2f} | {s['tau']:.2f} |",
            f"| speedup on this prompt | {speedup_cell(g['speedup'], *g['speedup_range'])} | "
            f"{speedup_cell(s['speedup'], *s['speedup_range'])} |",
            f"| output repeats | {g['repeat_rate']:.0%} | {s['repeat_rate']:.0%} |", "",
            "The first lines of each continuation (the sampled one as `--speculative` draws it; "
            "plain sampling draws other tokens from the same distribution):", "", "```",
            *side_by_side([("greedy", g["continuation"]),
                           (f"T = {s['temperature']:g}", s["continuation"])]), "```", "",
            "To reproduce (sample.py prints the tokens per pass and tokens/s on stderr; the greedy "
            "text is the same without `--speculative`):", "", "```", *g["commands"],
            *s["commands"], "```"]
