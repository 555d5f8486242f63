"""scripts/gpu_check.py, the check a session lent a GPU runs, dry-run on the CPU with a tiny model,
so that it does not rot between GPU sessions: every step runs and the summary has its rows."""
import json

import pytest
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # every step of the GPU check on a tiny model: over a minute on 2 cores
def test_the_gpu_check_runs_on_a_cpu(tmp_path):
    out = tmp_path / "out"
    env = {"MARFT_CHECK_WORK": str(tmp_path / "work"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
           "HOME": str(Path.home())}
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "run", "--dev", "cpu", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["steps"]) == {"device", "model", "train", "train_compile", "resume", "bench_rollout", "bench_train",
                                     "gpu_tests"}
    assert all(s["ok"] for s in summary["steps"].values()), summary["steps"]
    # trained one iteration, checkpointed, resumed for one more
    assert [m["iteration"] for m in summary["train"]["iterations"]] == [1, 2]
    assert summary["train"]["checkpoints"] == ["iter_000001", "iter_000002"]
    assert {"eval_untrained", "eval_final"} <= set(summary["train"]["evals"])
    # the same run compiled (rollout.compile, train.compile): trained, evaluated at the end
    assert [m["iteration"] for m in summary["train_compile"]["iterations"]] == [1]
    assert set(summary["train_compile"]["evals"]) == {"eval_final"}
    assert "rollout.compile and train.compile: the first calls of each agent compile" in (out / "check.log").read_text()
    rows = summary["bench_rollout"]["rows"]
    assert rows[0]["default"] and rows[-1]["path"].startswith("transformers generate") and all(r["tokens"] > 0 for r in rows)
    assert summary["bench_train"]["seconds"] > 0
    assert "skipped" in summary["gpu_tests"]  # no GPU here: the gpu tests say so
    table = (out / "summary.md").read_text()
    assert "whole iteration" in table and "step resume | ok" in table and "compiled: whole iteration" in table
