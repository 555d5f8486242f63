"""Programs executed per second in the sandbox, with 1..N workers, against an unisolated baseline.

    .venv/bin/python benchmarks/sandbox.py [--programs 64] [--workers 1 2 4 8] [--mbpp path/to/mbpp.jsonl]

Two workloads: a trivial program (``print(1)``: the fixed cost of one sandboxed run), and MBPP's
canonical solutions graded by ``run_tests`` (what grading a rollout costs: the sandboxed harness
and the checker process beside it; MBPP from ``--mbpp``, by default ``hf:google-research-datasets/mbpp:full``:
the Hub, or its local copy where ``MARFT_DATA_DIR`` is set; where neither can be read, a synthetic
three-test problem is used). For grading it also reports the CPU time per program, summed over
every process involved, which a busy machine disturbs far less than the throughput. The baseline is
the same program run with ``subprocess.run([python, "-I", "-S", ...])`` and no isolation or limits,
one at a time, in this same script.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft.envs.code import CodeProblem, load_mbpp, run_tests  # noqa: E402
from marft.errors import UserError  # noqa: E402
from marft.envs.sandbox import Limits, Sandbox  # noqa: E402

MBPP = "hf:google-research-datasets/mbpp:full"


def baseline(n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.py")
        Path(path).write_text("print(1)\n")
        t = time.perf_counter()
        for _ in range(n):
            subprocess.run([sys.executable, "-I", "-S", path], capture_output=True, check=True)
        return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--mbpp", default=MBPP, help="MBPP: an mbpp.jsonl file or an hf: reference (default: %(default)s)")
    a = ap.parse_args()
    print(f"{os.cpu_count()} CPU cores; protections: {', '.join(Sandbox().protections())}")
    try:
        problems = [p for p in load_mbpp(a.mbpp).values() if 11 <= p.task_id <= 510][: a.programs]
        label = f"MBPP canonical solutions, first {len(problems)} of the test split"
    except UserError as e:
        print(f"MBPP not read ({e}): a synthetic problem instead")
        p = CodeProblem("x", "", ["assert f(1) == 2", "assert f(2) == 4", "assert f(0) == 0"], "f", "", "",
                        "def f(x):\n    return 2 * x\n")
        problems, label = [p] * a.programs, "synthetic problem (MBPP data not found)"
    base = baseline(a.programs)
    print(f"baseline, plain subprocess without isolation, 1 at a time: {base:.1f} programs/s")
    print(f"\n| workers | print(1): programs/s | vs baseline | {label}: programs/s | CPU ms per program | all passed |")
    print("|---|---|---|---|---|---|")
    for w in a.workers:
        sb = Sandbox(Limits(wall_s=20, cpu_s=20), workers=w)
        jobs = [({"p.py": "print(1)\n"}, ["p.py"])] * a.programs
        t = time.perf_counter()
        res = sb.run_many(jobs)
        trivial = a.programs / (time.perf_counter() - t)
        assert all(r.stdout == "1\n" for r in res)
        t, cpu = time.perf_counter(), _cpu_s()
        reps = run_tests(sb, [(p.solution, p) for p in problems], test_timeout_s=10)
        graded, cpu_ms = len(problems) / (time.perf_counter() - t), 1000 * (_cpu_s() - cpu) / len(problems)
        ok = sum(r.all_passed for r in reps)
        print(f"| {w} | {trivial:.1f} | {trivial / base:.2f}x | {graded:.1f} | {cpu_ms:.0f} | {ok}/{len(problems)} |")


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (launchers, programs, checkers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


if __name__ == "__main__":
    main()
