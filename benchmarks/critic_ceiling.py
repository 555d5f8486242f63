"""How much of the return's variance a critic could explain on the cooperative sum duo (issue 44):
from evaluations that kept every episode's transcript (``marft eval ... eval.transcripts=256``),
the explained variance 1 - Var(R - V) / Var(R) of a value V that knows one thing about the state,
V = the mean return of the other episodes sharing that thing (leave-one-out, so that a value
fitted to noise does not count; a group of one gets the other episodes' mean). What it may know:

* at the speaker's turn, the problem: the sum of the two numbers, or the pair itself;
* at the solver's turn, also the speaker's message: whether it stated the speaker's number.

A critic explains at most about what the state's best-known summary does (more only where it sees
something these summaries miss). A figure near 0 means the episode's outcome is decided after the
state, by the solver's sampled reply, so that no critic can do much better than the batch's mean.

    .venv/bin/python benchmarks/critic_ceiling.py results/coop_critic_probe --out docs/results_critic
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NUMBERS = re.compile(r"speaker holds (\d+); solver holds (\d+)")

SUMMARIES = {  # what a value may know: a key of the episode
    "speaker's turn: the sum": lambda e: e["a"] + e["b"],
    "speaker's turn: the pair": lambda e: (e["a"], e["b"]),
    "solver's turn: the speaker stated its number": lambda e: e["stated"],
    "solver's turn: the sum and whether stated": lambda e: (e["a"] + e["b"], e["stated"]),
}


def episodes(path: Path) -> list[dict]:
    """The sum duo's episodes of one evaluation: the speaker's number ``a``, the solver's ``b``,
    whether the speaker's reply stated ``a`` (as a number of its own) and the return (1 or 0)."""
    out = []
    for t in json.loads(path.read_text())["transcripts"]:
        m = NUMBERS.search(t["observation"] or "")
        if m is None:
            raise SystemExit(f"{path}: not the sum duo's transcript (no 'speaker holds A; solver holds B')")
        a, b = int(m.group(1)), int(m.group(2))
        said = " ".join(x["reply"] for x in t["turns"] if x["agent"] == "speaker")
        out.append({"a": a, "b": b, "stated": str(a) in re.findall(r"\d+", said), "r": float(t["correct"])})
    return out


def explained(eps: list[dict], key) -> float | None:
    """Leave-one-out explained variance of the group-mean value (None when every return is the same)."""
    n = len(eps)
    total = sum(e["r"] for e in eps)
    mean = total / n
    var = sum((e["r"] - mean) ** 2 for e in eps)
    if var == 0 or n < 2:
        return None
    groups: dict = {}
    for e in eps:
        g = groups.setdefault(key(e), [0.0, 0])
        g[0] += e["r"]
        g[1] += 1
    err = 0.0
    for e in eps:
        s, c = groups[key(e)]
        value = (s - e["r"]) / (c - 1) if c > 1 else (total - e["r"]) / (n - 1)
        err += (e["r"] - value) ** 2
    return 1 - err / var


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a folder of evaluations, one subfolder per run with its eval.json")
    p.add_argument("--out", help="write ceiling.md here as well")
    args = p.parse_args(argv)
    files = sorted(Path(args.folder).glob("*/eval.json"))
    if not files:
        raise SystemExit(f"{args.folder}: no */eval.json")
    head = ["run", "episodes", "accuracy", "speaker stated its number", "accuracy if stated / not", *SUMMARIES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in files:
        eps = episodes(f)
        acc = sum(e["r"] for e in eps) / len(eps)
        stated = [e["r"] for e in eps if e["stated"]]
        not_stated = [e["r"] for e in eps if not e["stated"]]
        by = " / ".join(f"{100 * sum(x) / len(x):.0f}% of {len(x)}" if x else "none" for x in (stated, not_stated))
        evs = [explained(eps, k) for k in SUMMARIES.values()]
        lines.append("| " + " | ".join([f.parent.name, str(len(eps)), f"{100 * acc:.1f}%", f"{100 * len(stated) / len(eps):.0f}%", by,
                                        *("–" if v is None else f"{v:.2f}" for v in evs)]) + " |")
    text = ("Explained variance of the return (leave-one-out group means) by what a value knows, from each "
            f"run's held-out evaluation with every transcript kept (`{args.folder}`).\n\n" + "\n".join(lines) + "\n")
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ceiling.md").write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
