"""`--key=value` overrides of a script's config block, and device/dtype choice.

Each script keeps its whole config in one dict at its top (nanoGPT style); this file
only parses overrides against it: the type of each default is the type of the field,
an unknown key or a bad value is a one-line error that offers the closest key or names the
choices.
"""
import difflib
import sys

import torch


class UsageError(ValueError):
    """A bad command line; scripts print it as one line `error: ...` and exit 1."""


def _convert(key, raw, default):
    if isinstance(default, bool):
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise UsageError(f"--{key} takes True or False, not {raw!r}")
    for typ in (int, float):
        if isinstance(default, typ):
            try:
                return typ(raw)
            except ValueError:
                what = "an integer" if typ is int else "a number"
                raise UsageError(f"--{key} takes {what}, not {raw!r}") from None
    return raw


def config_notes(path):
    """{key: its comment} from a script's config block (the comment on a key's line, or the
    comment lines just above it), for --help; {} where the source cannot be read."""
    try:
        lines = open(path, encoding="utf-8").read().split("\nconfig = dict(\n", 1)[1]
    except (OSError, TypeError, IndexError):
        return {}
    notes, above = {}, []
    for line in lines.split("\n)\n", 1)[0].splitlines():
        code, _, comment = line.strip().partition("# ")
        if not code:  # a comment line: it describes the key below
            above.append(comment.strip())
        elif "=" in code:
            key = code.split("=", 1)[0].strip()
            notes[key] = " ".join(above + [comment.strip()]).strip()
            above = []
    return notes


def parse_args(config, argv=None, doc="", flags=(), given=None):
    """Return a copy of `config` with --key=value overrides applied.

    `flags` are keys that may be given bare (`--speculative` means `--speculative=True`).
    `given`: a set that receives the keys set on the command line.
    """
    argv = sys.argv[1:] if argv is None else argv
    given = set() if given is None else given
    cfg = dict(config)
    for arg in argv:
        if arg in ("-h", "--help"):
            print(doc.strip() + "\n\noptions (--key=value, defaults shown):")
            notes = config_notes(sys._getframe(1).f_globals.get("__file__"))
            width = max(len(f"{k} = {v!r}") for k, v in cfg.items())
            for k, v in cfg.items():
                print(f"  --{f'{k} = {v!r}':<{width}}  {notes.get(k, '')}".rstrip())
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r}; options are --key=value (see --help)")
        key, eq, raw = arg[2:].partition("=")
        if key not in cfg:
            close = difflib.get_close_matches(key, cfg, n=1)
            raise UsageError(f"unknown option --{key}; "
                             + (f"did you mean --{close[0]}?" if close else "see --help"))
        if not eq:
            if key not in flags:
                raise UsageError(f"--{key} needs a value: --{key}=VALUE (default {cfg[key]!r})")
            raw = "True"
        cfg[key] = _convert(key, raw, config[key])
        given.add(key)
    return cfg


def at_least(lo):
    return lambda v: v >= lo, f"at least {lo}"


def in_range(lo, hi, lo_open=False, hi_open=False):
    ok = lambda v: (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    return ok, f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def one_of(*choices):
    return lambda v: v in choices, "one of " + ", ".join(map(str, choices))


def check(cfg, rules):
    """Check every value against its meaning before any work starts: rules maps a key to
    (predicate, what it must be); the first violation is a one-line UsageError."""
    for key, (ok, must) in rules.items():
        if not ok(cfg[key]):
            raise UsageError(f"--{key}={cfg[key]!r}: must be {must} (see --help)")


def warn_unused(cfg, defaults, keys, condition):
    """Flags that do nothing in this combination say so, on stderr."""
    for key in keys:
        if cfg[key] != defaults[key]:
            print(f"warning: --{key} has no effect {condition}", file=sys.stderr)


def pick_device(name):
    """'auto' = cuda, then mps, then cpu (every script's default); anything else is checked to
    exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device=cuda but no CUDA device is available; use --device=cpu or "
                         "--device=auto")
    if kind == "mps" and not (getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()):
        raise UsageError("--device=mps but MPS is not available; use --device=cpu or --device=auto")
    if kind not in ("cpu", "cuda", "mps"):
        raise UsageError(f"unknown --device={name}; choose auto, cpu, cuda, cuda:N or mps")
    return name


def pick_dtype(name, device):
    """'auto' = bf16 on CUDA where supported (else fp16), fp32 on CPU and MPS; float64 is refused
    on MPS, which has none."""
    if name == "auto":
        if device.startswith("cuda"):
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return "float32"
    if name not in ("float32", "bfloat16", "float16", "float64"):
        raise UsageError(f"unknown --dtype={name}; choose auto, float32, bfloat16, float16 or "
                         "float64")
    if name == "float64" and device.split(":")[0] == "mps":
        raise UsageError("--dtype=float64: MPS has no float64; give --dtype=float32 (or bfloat16 "
                         "or float16)")
    return name
