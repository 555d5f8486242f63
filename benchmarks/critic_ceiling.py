"""How much of the return's variance a critic could explain on the cooperative tasks (issue 44):
from evaluations that kept every episode's transcript (``marft eval ... eval.transcripts=256``),
the explained variance 1 - Var(R - V) / Var(R) of a value V that knows one thing about the state,
V = the mean return of the other episodes sharing that thing (leave-one-out, so that a value
fitted to noise does not count), where at least ``MIN_OTHERS`` others share it, else the mean of
all the others (a mean over one or two episodes is noise, and would count against the value).
What it may know:

* at the first agent's turn, the problem: its answer (the sum of the numbers; the asked entry's
  value), or all its numbers;
* at the solver's turn, also the teammates' messages: whether every one stated its part (the
  sum: each speaker its number; the lookup: the speaker the asked word's entry).

A critic explains at most about what the state's best-known summary does (more only where it sees
something these summaries miss). A figure near 0 means the episode's outcome is decided after the
state, by the solver's sampled reply, so that no critic can do much better than the batch's mean.
The sum duo and trio and the lookup duo (``task.kind: coop``) are read.

    .venv/bin/python benchmarks/critic_ceiling.py results/coop_critic_probe --out docs/results_critic
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HOLDS = re.compile(r"(\w+) holds (\d+)")  # the sum: "speaker holds 4; solver holds 5."
TABLE = re.compile(r"Table: (?P<table>.*?)\. Asked: (?P<asked>\w+)")  # the lookup: "Table: mint=4, plum=0. Asked: mint (solver)."

SUMMARIES = {  # what a value may know: a key of the episode
    "first turn: the answer": lambda e: e["answer"],
    "first turn: the numbers": lambda e: e["numbers"],
    "solver's turn: every teammate stated its part": lambda e: e["stated"],
    "solver's turn: the answer and whether stated": lambda e: (e["answer"], e["stated"]),
}


def _asked(obs: str) -> tuple[str, int] | None:
    """The lookup's asked word and its entry's value, or None (not a lookup)."""
    table = TABLE.search(obs)
    if table is None:
        return None
    word = table.group("asked")
    return word, int(dict(kv.split("=") for kv in table.group("table").split(", "))[word])


def _answer(obs: str) -> int:
    """The problem's right answer (a transcript's ``answer`` is the team's): the sum of the numbers
    held, or the asked entry's value."""
    asked = _asked(obs)
    return asked[1] if asked else sum(int(n) for _, n in HOLDS.findall(obs))


def _stated(t: dict) -> bool:
    """Whether every teammate's reply stated its part of the problem."""
    said = {}
    for x in t["turns"]:
        said[x["agent"]] = said.get(x["agent"], "") + " " + x["reply"]
    asked = _asked(t["observation"])
    if asked:  # the lookup: the asked word with its number, as "mint=4", "mint: 4" or "mint is 4"
        pattern = re.compile(rf"\b{re.escape(asked[0])}\b\W{{0,3}}(?:is\s+)?{asked[1]}\b")
        return all(pattern.search(reply) for agent, reply in said.items() if agent != "solver")
    held = dict(HOLDS.findall(t["observation"]))
    return all(n in re.findall(r"\d+", said.get(agent, "")) for agent, n in held.items() if agent != "solver")


def episodes(path: Path) -> list[dict]:
    """A cooperative task's episodes of one evaluation: the problem's numbers, its answer, whether
    every teammate stated its part (:func:`_stated`) and the return (1 or 0)."""
    out = []
    for t in json.loads(path.read_text())["transcripts"]:
        obs = t["observation"] or ""
        if not (HOLDS.search(obs) or TABLE.search(obs)):
            raise SystemExit(f"{path}: not a cooperative sum or lookup transcript: {obs[:80]!r}")
        out.append({"numbers": tuple(int(n) for n in re.findall(r"\d+", obs)), "answer": _answer(obs),
                    "stated": _stated(t), "r": float(t["correct"])})
    return out


MIN_OTHERS = 4


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
        value = (s - e["r"]) / (c - 1) if c > MIN_OTHERS else (total - e["r"]) / (n - 1)
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
    head = ["run", "episodes", "accuracy", "teammates stated their parts", "accuracy if stated / not", *SUMMARIES]
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
    text = (f"Explained variance of the return (leave-one-out group means, a group of fewer than {MIN_OTHERS + 1} "
            "episodes valued at the others' mean) by what a value knows, from each "
            f"run's held-out evaluation with every transcript kept (`{args.folder}`).\n\n" + "\n".join(lines) + "\n")
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ceiling.md").write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
