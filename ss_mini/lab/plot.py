"""Figures of bench.py's measurements: bench.py --plot=FILE.png draws the tree search.

matplotlib is an optional extra (pip install -e ".[plot]"); nothing imports it until a
figure is drawn, and `check` says how to get it before any work starts.
"""
import os
import tempfile

from ..io.cli import UsageError

FORMATS = (".png", ".svg", ".pdf")


def check(path, searched=True):
    """Before any work: matplotlib is there, the file can be written, and there is something to
    draw."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError('--plot needs matplotlib: pip install -e ".[plot]" (or pip install '
                         'matplotlib)') from None
    if os.path.splitext(path)[1].lower() not in FORMATS:
        raise UsageError(f"--plot={path}: give a file name ending in {', '.join(FORMATS)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--plot={path}: the folder {folder} does not exist; create it or pick "
                         "another path")
    if not searched:
        raise UsageError("--plot draws the tree search of one model: use --tree=auto or --sweep, "
                         "without --compare, --pass_cost or --suite")


def tree_search(rows, best, path, title="", tie_margin=0.0, n_streams=0):
    """Speedup and tau of each candidate tree against its node count, the chosen tree marked,
    autoregressive decoding at 1.0 on both. rows: (spec, nodes, bench summary) of
    tree_choice.tree_search; best: the chosen spec; tie_margin: the band below the fastest within
    which the search takes the smallest tree (shaded); n_streams: the model's (which budgets
    are chains). Cartesian trees are dots, node budgets
    squares joined by a line (one family). Written atomically (temp file, then os.replace)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no window

    rows = [row for row in rows if row[0] != "none"]  # no tree: the autoregressive line
    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2, sharex=True)
    for ax, key, label in ((axes[0], "speedup", "speedup over autoregressive"),
                           (axes[1], "mean_accepted",
                            "\u03c4: tokens per pass (accepted drafts + 1)")):
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.annotate("autoregressive", (0, 1.0), xycoords=("axes fraction", "data"), xytext=(3, 3),
                    textcoords="offset points", color="gray", fontsize=8)
        budget = sorted((n, r[key]) for spec, n, r in rows if spec.startswith("n"))
        if budget:
            ax.plot(*zip(*budget), "s-", color="tab:orange", markersize=5, linewidth=1,
                    label="node budget (nN)")
        cart = [(n, r[key]) for spec, n, r in rows if not spec.startswith("n")]
        if cart:
            ax.plot(*zip(*cart), "o", color="tab:blue", markersize=6,
                    label="top-k per depth (k,k,k)")
        # budget labels left of their points, Cartesian ones right: they share node counts
        for spec, n, r in rows:
            budget = spec.startswith("n")
            ax.annotate(same_as_chain(spec, n_streams), (n, r[key]), textcoords="offset points",
                        fontsize=7, xytext=(-5, 3) if budget else (5, -3),
                        ha="right" if budget else "left", va="bottom" if budget else "top")
            if spec == best:
                ax.plot([n], [r[key]], "*", color="tab:red", markersize=16, zorder=3,
                        label=f"chosen: {same_as_chain(spec, n_streams)}")
        ax.set_xlabel("nodes in the tree")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        lo, hi = min(n for _, n, _ in rows), max(n for _, n, _ in rows)
        ax.set_xlim(lo / 1.4, hi * 1.4)
        ticks = [2 ** k for k in range(9) if lo / 1.4 <= 2 ** k <= hi * 1.4]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.margins(y=0.1)
    if tie_margin:
        fastest = max(r["speedup"] for _, _, r in rows)
        axes[0].axhspan((1 - tie_margin) * fastest, fastest, color="tab:red", alpha=0.08, zorder=0,
                        label=f"within {tie_margin:.0%} of the fastest")
    axes[0].legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    save(fig, path)


def same_as_chain(spec, n_streams):
    """A budget of n nodes that holds only the top-1 chain is that chain (n4 is 1,1,1 when the
    model has 3 or more streams): say so, so that one tree is not read as two."""
    n = int(spec[1:]) if spec.startswith("n") and spec[1:].isdigit() else 0
    return f"{spec} (= {','.join(['1'] * (n - 1))})" if 2 <= n <= n_streams + 1 else spec


def batch_sweep(rows, path, title=""):
    """Tokens/s of the whole batch against the batch size, plain and speculative decoding
    (with the tree chosen at each size), both axes logarithmic. rows: bench's sweep rows."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100, layout="constrained")
    ax = fig.subplots()
    bs = [r["batch_size"] for r in rows]
    ax.plot(bs, [r["ar_tokens_per_s"] for r in rows], "o-", color="gray",
            label="plain (autoregressive)")
    ax.plot(bs, [r["ss_tokens_per_s"] for r in rows], "s-", color="tab:blue",
            label="speculative, tree chosen per size")
    for r in rows:
        ax.annotate(r["tree"], (r["batch_size"], r["ss_tokens_per_s"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.minorticks_off()
    ax.set_xlabel("batch size (sequences decoded at once)")
    ax.set_ylabel("tokens/s, the whole batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    save(fig, path)


def save(fig, path):
    """Write the figure atomically: a temp file in the target's folder, then os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    ext = os.path.splitext(path)[1]
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".plot-", suffix=ext)
    os.close(fd)
    try:
        fig.savefig(tmp, format=ext[1:].lower())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
