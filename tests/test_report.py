"""``marft report`` on synthetic run folders: known numbers in, known table out; missing, failed
and partial runs are reported, not dropped; plots are real PNG images."""
import json
import struct

import pytest

from marft.cli import main
from marft.run.config import load_config, save_config
from marft.experiments.report import build_report, comparisons, find_runs
from marft.maths.stats import seed_interval, spearman, t_quantile_975, welch_interval


def make_run(folder, seed, final, untrained=None, iterations=3, metrics=None, without=None, algorithm="marft", sweep_labels=None,
             solver_cut=0.0):
    folder.mkdir(parents=True)
    save_config(load_config("configs/duo_arithmetic.yaml", [f"seed={seed}", f"train.iterations={iterations}",
                                                            f"train.algorithm={algorithm}", f"output_dir={folder}"]),
                folder / "config.yaml")
    if metrics is None:
        metrics = [{"iteration": i + 1, "reward": 0.1 * (i + 1), "accuracy": 0.1 * (i + 1), "seconds": 60.0,
                    "planner/approx_kl": 0.01, "solver/approx_kl": 0.02, "planner/entropy": 1.0,
                    "solver/entropy": 0.9, "value_loss": 0.5} for i in range(iterations)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))

    def result(per):
        return {"accuracy": sum(per) / len(per), "ci95": [0.0, 1.0], "per_problem_success": per, "seconds": 30.0,
                "extraction_rate": 0.75, "agents": {"planner": {"mean_tokens": 30.2, "truncated": 0.5},
                                                    "solver": {"mean_tokens": 9.0, "truncated": solver_cut}}}

    if untrained is not None:
        (folder / "eval_untrained.json").write_text(json.dumps(result(untrained)))
    if final is not None:
        (folder / "eval_final.json").write_text(json.dumps(result(final)))
    for agent, per in (without or {}).items():
        (folder / f"eval_final_without_{agent}.json").write_text(json.dumps(result(per)))
    if sweep_labels:
        (folder / "sweep_run.json").write_text(json.dumps({"labels": sweep_labels}))


@pytest.fixture
def sweep_dir(tmp_path):
    root = tmp_path / "sweep"
    runs = []

    def add(name, labels, status="complete", **kw):
        if kw:
            make_run(root / name, labels["seed"], sweep_labels=labels, **kw)
        runs.append({"name": name, "folder": name, "labels": labels, "status": status})

    add("m0", {"algorithm": "marft", "seed": "0"}, final=[1, 0, 1, 0], untrained=[0, 0, 1, 0], without={"planner": [0, 0, 1, 0]})
    add("m1", {"algorithm": "marft", "seed": "1"}, final=[1, 1, 1, 0], untrained=[0, 0, 1, 0], without={"planner": [1, 0, 1, 0]})
    add("i0", {"algorithm": "ippo", "seed": "0"}, final=[0, 0, 0, 1], untrained=[0, 0, 1, 0])
    add("i1", {"algorithm": "ippo", "seed": "1"}, status="pending")  # never started: no folder
    add("g0", {"algorithm": "grpo", "seed": "0"}, status="failed (exit 2)", final=None, untrained=[0, 0, 1, 0], iterations=5,
        metrics=[{"iteration": 1, "reward": 0.0, "accuracy": 0.0, "seconds": 10.0}])
    add("g1", {"algorithm": "grpo", "seed": "1"}, final=None, untrained=[0, 0, 1, 0], iterations=5,
        metrics=[{"iteration": 1, "reward": 0.0}, {"iteration": 2, "reward": 0.0}])
    (root / "sweep.json").write_text(json.dumps({"runs": runs}))
    return root


def test_known_numbers_in_known_table_out(sweep_dir):
    report = build_report(find_runs([str(sweep_dir)]))
    rows = {r["labels"]["algorithm"]: r for r in report["groups"]}
    m = rows["marft"]
    assert m["runs_complete"] == m["runs_planned"] == 2
    assert m["final"]["mean"] == pytest.approx(0.625)
    assert m["final"]["std"] == pytest.approx(0.1767767, abs=1e-6)  # stdev of 0.5 and 0.75
    # pooled: per-problem means over seeds 1, .5, 1, 0 -> sd .4787, se .2394, n_eff = .625 * .375 / se^2
    # = 4.091; Wilson at p .625, n 4.091: centre .5645, half-width .3423
    assert m["final"]["ci95"] == pytest.approx([0.22216, 0.90676], abs=1e-4)
    assert m["final"]["per_seed"] == [0.5, 0.75] and m["final"]["ci95_seeds"] == [0.0, 1.0]  # see below
    assert m["untrained"]["mean"] == pytest.approx(0.25) and m["untrained"]["std"] == 0.0
    # per-problem 0, 0, 1, 0: sd .5, se .25, n_eff 3; Wilson at p .25, n 3
    assert m["untrained"]["ci95"] == pytest.approx([0.03684, 0.74391], abs=1e-4)
    assert m["delta"] == pytest.approx(0.375)
    assert m["train_minutes"] == pytest.approx(3.0)
    assert m["without"]["planner"] == {"with": pytest.approx(0.625), "without": pytest.approx(0.375), "seeds": 2}
    i = rows["ippo"]
    assert (i["runs_complete"], i["runs_planned"]) == (1, 2)
    assert i["final"]["std"] is None and i["final"]["ci95"] == [0.0, 1.0]  # one seed: the run's own interval
    assert i["incomplete"] == [{"folder": str(sweep_dir / "i1"), "seed": "1", "status": "not started"}]
    g = rows["grpo"]
    assert g["final"] is None and g["runs_complete"] == 0
    assert [x["status"] for x in g["incomplete"]] == ["failed (exit 2)", "partial (2/5 iterations)"]
    assert report["runs"] == 6 and report["complete"] == 3
    # 3 complete runs x 3 iterations x 60 s + the failed run's 10 s; 10 evaluations x 30 s
    assert report["train_minutes"] == pytest.approx(9 + 10 / 60) and report["eval_minutes"] == pytest.approx(5.0)


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("df, table", [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (10, 2.228),
                                       (30, 2.042), (120, 1.980)])
def test_t_quantile_matches_the_printed_table(df, table):
    assert t_quantile_975(df) == pytest.approx(table, abs=6e-4)


def test_t_quantile_between_whole_degrees_of_freedom_lies_between_their_quantiles():
    assert t_quantile_975(3) < t_quantile_975(2.5) < t_quantile_975(2)


def test_welch_interval_by_hand():
    # means .5 and .2; each variance of the mean .01 / 3; Welch df = (2v)^2 / (2 v^2 / 2) = 4, t = 2.776
    # half-width 2.776 * sqrt(.02 / 3) = .22667
    assert welch_interval([0.6, 0.5, 0.4], [0.3, 0.2, 0.1]) == pytest.approx([0.07333, 0.52667], abs=1e-4)
    assert welch_interval([0.6, 0.5], [0.3]) is None
    assert welch_interval([0.9, 0.9], [0.5, 0.5]) == pytest.approx([0.4, 0.4])
    assert welch_interval([0.93, 0.23], [0.3, 0.2]) == [-1.0, 1.0]  # two seeds, one of them a failure


def test_comparisons_pair_groups_that_differ_in_one_label():
    def row(team, algorithm, accs):
        return {"labels": {"team": team, "algorithm": algorithm}, "final": {"per_seed": accs}}
    rows = [row("2", "untrained", [0.3]), row("2", "marft", [0.9, 0.8, 0.85]), row("2", "ippo", [0.6, 0.5, 0.4]),
            row("3", "marft", [0.6, 0.5, 0.4]), row("3", "ippo", [0.3, 0.2, 0.1])]
    got = {(c["axis"], c["a"], c["b"], tuple(c["same"].values())): c for c in comparisons(rows)}
    # the untrained team is the baseline, not a recipe; team 2 ippo and team 3 marft differ in two labels
    assert sorted(got) == [("algorithm", "marft", "ippo", ("2",)), ("algorithm", "marft", "ippo", ("3",)),
                           ("team", "2", "3", ("ippo",)), ("team", "2", "3", ("marft",))]
    c = got[("algorithm", "marft", "ippo", ("3",))]
    assert c["diff"] == pytest.approx(0.3) and c["ci95"] == pytest.approx([0.07333, 0.52667], abs=1e-4)
    assert c["seeds"] == [3, 3]
    assert [c["axis"] for c in comparisons(rows)][:2] == ["algorithm", "algorithm"]


def test_seed_interval_is_students_t_over_the_runs():
    # .6, .5, .4: mean .5, sd .1, se .1 / sqrt(3) = .057735; t(0.975, 2) = 4.3027 -> half-width .24841
    assert seed_interval([0.6, 0.5, 0.4]) == pytest.approx([0.25159, 0.74841], abs=1e-5)
    # one run that learned and one that did not: the interval says the recipe is a coin toss,
    # however well each run was measured
    lo, hi = seed_interval([0.93, 0.23, 0.90])
    assert lo < 0.25 and hi == 1.0
    assert seed_interval([0.7]) is None
    assert seed_interval([0.8, 0.8, 0.8]) == pytest.approx([0.8, 0.8])


def test_report_command_writes_markdown_json_and_plots(sweep_dir, capsys):
    out = sweep_dir / "out"
    assert main(["report", str(sweep_dir), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    # two seeds: t(0.975, 1) = 12.71 times se .125 spans all of [0, 1]
    assert "| marft | 2/2 | 25.0 ± 0.0 | 3.7–74.4 | 62.5 ± 17.7 | 50.0 / 75.0 | 22.2–90.7 | 0.0–100.0 | +37.5 | 3.0 |" in md
    assert "| ippo | 1/2 ⚠ | 25.0 | 0.0–100.0 | 25.0 | 25.0 | 0.0–100.0 | – | +0.0 | 3.0 |" in md
    assert f"- {sweep_dir / 'i1'} (seed 1): not started" in md
    assert f"- {sweep_dir / 'g0'} (seed 0): failed (exit 2)" in md
    assert f"- {sweep_dir / 'g1'} (seed 1): partial (2/5 iterations)" in md
    assert "| marft | planner | 2 | 62.5 | 37.5 | +25.0 |" in md  # over the 2 seeds evaluated without it
    assert "| marft | 1 | 75.0 | 75.0 | planner 30 / 50%, solver 9 / 0% |" in md  # each run's replies
    assert "| ippo | 0 | 25.0 | 75.0 |" in md and "| grpo |" not in md.split("final evaluation")[1]
    data = json.loads((out / "report.json").read_text())
    assert len(data["groups"]) == 3
    plots = sorted(out.glob("*.png"))
    assert [p.name for p in plots] == ["curves_all.png"]
    w, h = png_size(plots[0])
    assert (w, h) == (1280, 528) and plots[0].stat().st_size < 300_000
    assert "![curves_all.png](curves_all.png)" in md


def test_a_mixtures_per_task_curves_are_labelled_as_tasks_not_agents(tmp_path, monkeypatch):
    import matplotlib.figure

    from marft.experiments.report import RunInfo, plot_curves
    from marft.experiments.report.render import series_label
    assert series_label("tasks/arith/reward", "reward") == "task: arith"
    assert series_label("tasks/gsm8k/test/accuracy", "accuracy") == "task: gsm8k/test"
    assert series_label("planner/approx_kl", "approx_kl") == "agent: planner"
    assert series_label("value_loss/planner", "value_loss") == "agent: planner"
    assert series_label("critic/explained_variance/planner", "critic/explained_variance") == "agent: planner"
    assert series_label("critic/explained_variance", "critic/explained_variance") == ""
    assert series_label("reward", "reward") == ""
    metrics = [{"iteration": i, "reward": 0.5, "accuracy": 0.5, "tasks/arith/reward": 0.4, "tasks/sum/reward": 0.6,
                "tasks/arith/accuracy": 0.4, "tasks/arith/episodes": 3, "planner/approx_kl": 0.01} for i in (1, 2)]
    legends = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: legends.extend(
        t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()))
    plot_curves([RunInfo(tmp_path, {"algorithm": "marft"}, "0", "complete", metrics=metrics)], tmp_path)
    assert legends == ["marft", "task: arith", "task: sum", "agent: planner"], legends


def test_runs_outside_a_sweep_are_labelled_from_their_config(tmp_path):
    make_run(tmp_path / "a", 0, final=[1, 1, 0, 0], untrained=[0, 0, 0, 0])
    make_run(tmp_path / "b", 1, final=[1, 0, 0, 0], untrained=[0, 0, 0, 0])
    make_run(tmp_path / "c", 0, final=[1, 1, 1, 1], untrained=[0, 0, 0, 0], algorithm="grpo")
    report = build_report(find_runs([str(tmp_path)]))
    rows = {r["labels"]["algorithm"]: r for r in report["groups"]}
    assert rows["marft"]["labels"] == {"task": "basic_arithmetic", "team": "duo", "algorithm": "marft"}
    assert rows["marft"]["final"]["mean"] == pytest.approx(0.375) and rows["marft"]["runs_complete"] == 2
    assert rows["grpo"]["final"]["mean"] == 1.0


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [9, 1, 0, -5]) == pytest.approx(-1.0)  # monotone, not linear: still -1
    # ties share their mean rank: x ranks 1.5 1.5 3 4, y ranks 1 3 2 4; about the mean 2.5 the
    # products sum to 3.0, the squares to 4.5 and 5.0: r = 3 / sqrt(22.5)
    assert spearman([0, 0, 1, 2], [1, 3, 2, 4]) == pytest.approx(3 / 22.5 ** 0.5)
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


def test_graded_agents_cut_share_against_accuracy_over_trained_runs(tmp_path):
    # the duo's graded agent is the solver; the untrained run (cut 1.0, accuracy 0) is left out,
    # else it would pull the correlation to -1 by itself
    make_run(tmp_path / "u", 0, final=[0, 0, 0, 0], iterations=0, metrics=[], solver_cut=1.0)
    make_run(tmp_path / "a", 0, final=[1, 1, 1, 0], solver_cut=0.0)
    make_run(tmp_path / "b", 1, final=[1, 1, 0, 0], solver_cut=0.5)
    make_run(tmp_path / "c", 2, final=[1, 0, 0, 0], solver_cut=0.2)
    report = build_report(find_runs([str(tmp_path)]))
    assert {e["graded"] for e in report["each_run"]} == {"solver"}
    cut = report["graded_cut_vs_accuracy"]
    assert cut["runs"] == 3 and cut["spearman"] == pytest.approx(-0.5)  # ranks (1, 3, 2) against (3, 2, 1)


def test_report_of_nothing_is_a_user_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no marft runs" in capsys.readouterr().err


def test_untrained_row_is_the_baseline_of_its_group(tmp_path):
    root = tmp_path / "s"
    make_run(root / "u", 0, final=[0, 0, 0, 1], iterations=0, metrics=[], sweep_labels={"team": "2", "algorithm": "untrained", "seed": "0"})
    make_run(root / "m", 0, final=[0, 1, 1, 1], sweep_labels={"team": "2", "algorithm": "marft", "seed": "0"})
    make_run(root / "t", 0, final=[1, 1, 1, 1], sweep_labels={"team": "3", "algorithm": "marft", "seed": "0"})
    rows = {(r["labels"]["team"], r["labels"]["algorithm"]): r for r in build_report(find_runs([str(root)]))["groups"]}
    assert rows[("2", "marft")]["untrained"]["mean"] == 0.25 and rows[("2", "marft")]["delta"] == pytest.approx(0.5)
    assert rows[("3", "marft")]["untrained"] is None and rows[("3", "marft")]["delta"] is None  # no baseline for team 3


def test_a_baseline_run_counts_its_one_evaluation_once(tmp_path):
    # train.iterations=0: eval_final.json is a copy of eval_untrained.json (30 s each in make_run)
    make_run(tmp_path / "u0", 0, final=[0, 1], untrained=[0, 1], iterations=0, metrics=[])
    report = build_report(find_runs([str(tmp_path)]))
    assert report["eval_minutes"] == pytest.approx(0.5) and report["train_minutes"] == 0


def test_learning_curve_against_training_minutes(tmp_path, capsys):
    from marft.experiments.report.read import evaluations

    run = tmp_path / "main"
    make_run(run, 0, final=[1, 1, 1, 0], untrained=[0, 0, 1, 0], iterations=4)
    mid = {"accuracy": 0.5, "ci95": [0.2, 0.8], "per_problem_success": [1, 0, 1, 0], "iteration": 2}
    (run / "eval_iter_000002.json").write_text(json.dumps(mid))
    final = json.loads((run / "eval_final.json").read_text())
    (run / "eval_final.json").write_text(json.dumps({**final, "iteration": 4}))
    assert [(e["iteration"], e["accuracy"]) for e in evaluations(run)] == [(0, 0.25), (2, 0.5), (4, 0.75)]
    out = tmp_path / "out"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert (out / "learning_main.png").is_file() and png_size(out / "learning_main.png") == (630, 360)
    assert "![learning_main.png](learning_main.png)" in (out / "report.md").read_text()


def test_learning_speed_by_hand(tmp_path):
    """Area = the mean training accuracy; steps_to = optimiser steps per agent after which the
    trailing mean of 5 iterations first reaches 50% (the duo's config: 32 episodes in minibatches of
    16, one epoch: 2 steps per iteration)."""
    from marft.experiments.report import learning_speed

    curve = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    s = learning_speed([{"iteration": i + 1, "accuracy": a} for i, a in enumerate(curve)], 4)
    # iteration 5: (0 + .2 + .4 + .6 + .8) / 5 = 0.4; iteration 6: (.2 + .4 + .6 + .8 + 1) / 5 = 0.6
    assert s == {"area": pytest.approx(4.0 / 7), "iterations": 7, "reached_at_iteration": 6, "steps_to": 24}
    assert learning_speed([{"iteration": 1, "accuracy": 0.9}] * 4, 4)["steps_to"] is None  # fewer than 5 iterations
    assert learning_speed([], 4) is None
    fast = [{"iteration": i + 1, "accuracy": a, "seconds": 1.0} for i, a in enumerate(curve)]
    slow = [{"iteration": i + 1, "accuracy": a / 2, "seconds": 1.0} for i, a in enumerate(curve)]
    for seed in (0, 1):
        make_run(tmp_path / f"f{seed}", seed, final=[1, 1], iterations=7, metrics=fast)
        make_run(tmp_path / f"s{seed}", seed, final=[1, 0], iterations=7, metrics=slow, algorithm="ippo")
    report = build_report(find_runs([str(tmp_path)]))
    rows = {r["labels"]["algorithm"]: r for r in report["groups"]}
    assert rows["marft"]["speed"]["per_seed"] == [pytest.approx(4.0 / 7)] * 2
    assert rows["marft"]["speed"]["steps_to"] == [12, 12] and rows["ippo"]["speed"]["steps_to"] == [None, None]
    (c,) = report["speed_comparisons"]
    assert (c["a"], c["b"]) == ("marft", "ippo") and c["diff"] == pytest.approx(2.0 / 7)


def test_the_report_says_where_the_runs_ran(tmp_path):
    make_run(tmp_path / "a", 0, final=[1, 0])
    make_run(tmp_path / "b", 1, final=[1, 1])
    make_run(tmp_path / "c", 2, final=[0, 0])
    make_run(tmp_path / "d", 3, final=[1, 0])
    (tmp_path / "a" / "machine.json").write_text(json.dumps([{"cpu": "Intel Xeon", "cpu_cores": 2, "cpu_bf16": ["amx_bf16"],
                                                               "gpu": None, "device": "cpu", "dtype": "bfloat16", "torch_threads": 1}]))
    (tmp_path / "b" / "sweep_run.json").write_text(json.dumps({"labels": {"seed": "1"}, "machines": ["AMD EPYC, 2 cores"]}))
    (tmp_path / "d" / "machine.json").write_text(json.dumps([{"cpu": "Intel Xeon", "cpu_cores": 16, "cpu_bf16": [], "torch_threads": 16,
                                                               "gpu": "NVIDIA H100 80GB HBM3", "device": "cuda", "dtype": "bfloat16"}]))
    report = build_report(find_runs([str(tmp_path)]))
    assert report["machines"] == {"Intel Xeon (AMX, 2 cores, 1 thread), cpu, bfloat16": 1, "AMD EPYC, 2 cores": 1,
                                  "NVIDIA H100 80GB HBM3, cuda, bfloat16": 1, "not recorded": 1}  # threads only where they count
    from marft.experiments.report import to_markdown
    assert ("Machines (every run with a result, finished or not): Intel Xeon (AMX, 2 cores, 1 thread), cpu, bfloat16: 1 run; "
            "AMD EPYC, 2 cores: 1 run; not recorded: 1 run; NVIDIA H100 80GB HBM3, cuda, bfloat16: 1 run.") in to_markdown(report, [])


def test_malformed_files_are_left_out_with_a_one_line_warning_each(tmp_path, capsys):
    """A report over many run folders goes on past malformed files (as past a missing one): each is
    named in one warning line, left out, and its run still listed; the good runs are reported whole."""
    for name, seed in (("good", 0), ("list", 1), ("line", 2), ("bytes", 3), ("labels", 4)):
        make_run(tmp_path / name, seed, final=[1, 0, 1, 0], untrained=[0, 0, 1, 0])
    (tmp_path / "list" / "eval_final.json").write_text("[1, 2]")
    with open(tmp_path / "line" / "metrics.jsonl", "a") as f:
        f.write("[]\n" + json.dumps({"iteration": 9, "reward": 1.0}) + "\n")
    (tmp_path / "bytes" / "metrics.jsonl").write_bytes(b'{"iteration": 1, "reward": 0.5}\n\xff\xfe not text\n')
    (tmp_path / "labels" / "sweep_run.json").write_text('{"labels": [1, 2]}')
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    warnings = [x for x in err.splitlines() if x.startswith("marft report: warning:")]
    assert warnings == [
        f"marft report: warning: {tmp_path / 'bytes' / 'metrics.jsonl'} line 2 is not UTF-8 text (byte 0xff); it and the lines "
        "after it are left out",
        f"marft report: warning: {tmp_path / 'labels' / 'sweep_run.json'} has no labels mapping; the run is labelled from its config.yaml",
        f"marft report: warning: {tmp_path / 'line' / 'metrics.jsonl'} line 4 is not a metrics record (a JSON object with a "
        "whole-number iteration); it and the lines after it are left out",
        f"marft report: warning: {tmp_path / 'list' / 'eval_final.json'} is not a marft evaluation result (it holds a JSON list, "
        "not an object); left out"]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["runs"] == 5 and report["complete"] == 4  # the run with the bad eval_final.json is listed, not complete
    (group,) = report["groups"]
    assert group["incomplete"] == [{"folder": str(tmp_path / "list"), "seed": "1", "status": "partial (3/3 iterations)"}]
    assert all(p.read_bytes() == b for p, b in before.items())  # the report reads, never writes, run folders
    runs = {r.folder.name: r for r in find_runs([str(tmp_path)])}
    assert [m["iteration"] for m in runs["line"].metrics] == [1, 2, 3] and len(runs["bytes"].metrics) == 1


def test_a_run_reached_twice_counts_once_and_set_aside_attempts_are_not_runs(sweep_dir, tmp_path, capsys):
    """`marft report SWEEP SWEEP/m0` (or two paths to one sweep) reads m0 once, saying so; a folder
    of runs without a sweep.json does not count a run's earlier_attempt_N/ as one more run."""
    once = build_report(find_runs([str(sweep_dir)]))
    twice = build_report(find_runs([str(sweep_dir), str(sweep_dir / "m0")]))
    assert twice["groups"] == once["groups"]
    assert "m0 was given twice" in capsys.readouterr().err
    make_run(tmp_path / "plain" / "a", 0, final=[1, 1, 0, 0], untrained=[0, 0, 0, 0])
    make_run(tmp_path / "plain" / "a" / "earlier_attempt_1", 0, final=None, untrained=[0, 0, 0, 0])
    assert [r.folder.name for r in find_runs([str(tmp_path / "plain")])] == ["a"]


def test_a_group_whose_runs_ran_on_two_kinds_of_machine_is_named(tmp_path):
    """A seed repeats a run only on the same kind of machine: a group mixing two is listed under
    the table with its machines; a group on one is not."""
    from marft.experiments.report import to_markdown

    for name, seed, machine in [("a0", 0, "Intel Xeon, bf16"), ("a1", 1, "AMD EPYC, float32"), ("b0", 0, "AMD EPYC, float32")]:
        make_run(tmp_path / name, seed, final=[1, 0, 1, 0], untrained=[0, 0, 0, 0], algorithm="grpo" if name == "b0" else "marft")
        (tmp_path / name / "sweep_run.json").write_text(json.dumps({"machines": [machine]}))
    report = build_report(find_runs([str(tmp_path)]))
    rows = {r["labels"]["algorithm"]: r for r in report["groups"]}
    assert rows["marft"]["machines"] == ["AMD EPYC, float32", "Intel Xeon, bf16"] and len(rows["grpo"]["machines"]) == 1
    md = to_markdown(report, [])
    assert "ran on more than one kind of machine" in md
    assert "algorithm marft: AMD EPYC, float32; Intel Xeon, bf16" in md and "algorithm grpo:" not in md
