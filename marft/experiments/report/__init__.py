"""``marft report RUN_DIR...``: the table of held-out scores, training curves and per-agent views.

Inputs: run folders of ``marft train`` (``config.yaml``, ``metrics.jsonl``, ``eval_untrained.json``,
``eval_final.json``, ``eval_final_without_<agent>.json``), folders that hold such runs, and sweep
folders (``sweep.json`` lists the planned runs, so a run that never started is reported too).

Runs are grouped by their labels without the seed: a sweep's axis labels (``sweep_run.json``), or
for other runs task, team, algorithm (``-ps`` with a shared adapter). Per group:

- **final**: mean and sample standard deviation over seeds of the held-out accuracy, and two 95%
  intervals that answer different questions. *Problems*: pools every seed's problems, with the
  problems as the independent units (the same estimator as ``marft eval`` with several samples,
  ``evaluate.accuracy_interval``, on the problems x seeds table; with one seed, that run's own
  interval from ``marft eval``): how well these trained teams are measured. *Seeds*: Student's t
  over the seeds' accuracies, the runs as the units (mean +- t(0.975, S-1) s / sqrt(S), clipped to
  [0, 1]; needs two seeds): where another run of the same recipe may land. Algorithms compared on
  the same problems differ by more than noise only where their seed intervals part; the problem
  interval alone hides a recipe that succeeds with one seed and fails with the next;
- **each run**: its final accuracy, answer-extraction rate, and per agent the mean reply length
  and the share of replies cut at the limit (``eval_final.json``'s ``agents``); over the trained
  runs (not ``algorithm: untrained``), Spearman's rank correlation between the graded agent's
  (the last answering one, whose answer decides success) share of cut replies and accuracy;
- **differences between recipes**: for each pair of groups whose labels differ in one (an
  algorithm against another on one team, one team size against another under one algorithm), the
  difference of the seed means with its Welch 95% interval over seeds;
- **learning speed** (:func:`learning_speed`): per group, the mean training accuracy over the
  run (the area under the learning curve) with its interval over seeds, the optimiser steps per
  agent until the trailing mean of 5 iterations reaches 50% per seed, and the same pairwise
  differences as for the final accuracy;
- **untrained**: the same for ``eval_untrained.json`` (the team before training, same problems),
  or, for runs that skipped it (``eval.before=false``), the final score of the group labelled
  ``algorithm: untrained`` (a ``train.iterations=0`` run) with the same other labels;
- **runs**: complete / planned; a group with runs missing, failed or stopped early says so, and
  those runs are listed under the table: nothing is silently dropped. A malformed file (an
  ``eval_*.json`` that is not an evaluation result, a ``metrics.jsonl`` line that is not a metrics
  record or not UTF-8, a ``sweep.json`` or ``sweep_run.json`` of the wrong shape) is left out with
  one ``marft report: warning: ...`` line naming it, and its run is still listed.

Writes ``report.md`` and ``report.json`` and, per group without the algorithm axis, a PNG of the
training curves (reward, training accuracy, then KL, entropy and value loss per agent), the
seeds' mean per iteration; and per run evaluated at three or more points (untrained, every
``train.eval_every`` iterations, final), a learning curve: training reward and held-out accuracy
with its interval against training minutes (``learning_<run>.png``).
"""
from __future__ import annotations

import json
from pathlib import Path

from ...errors import UserError
from .build import SPEED_THRESHOLD, SPEED_WINDOW, build_report, comparisons, learning_speed
from .read import RunInfo, find_runs
from .render import CURVES, plot_curves, plot_learning, to_markdown

__all__ = ["RunInfo", "find_runs", "build_report", "comparisons", "learning_speed", "SPEED_THRESHOLD", "SPEED_WINDOW",
           "to_markdown", "plot_curves", "plot_learning", "CURVES", "cmd_report"]


def cmd_report(args) -> int:
    import sys

    runs = find_runs(args.runs)
    out = Path(args.out) if args.out else Path(args.runs[0]) / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the report folder {out} ({e.strerror}); choose another --out") from None
    report = build_report(runs)
    plots = plot_curves(runs, out) + plot_learning(runs, out)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    md = to_markdown(report, plots)
    (out / "report.md").write_text(md)
    print(md)
    print(f"marft report: {report['complete']} of {report['runs']} runs complete; wrote {out / 'report.md'}, "
          f"{out / 'report.json'} and {len(plots)} plot(s)", file=sys.stderr)
    return 0
