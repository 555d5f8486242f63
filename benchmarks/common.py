"""What the benchmark scripts share: the settings BENCHMARKS.md's figures were measured with, and
the CPU's name for their headers."""
from __future__ import annotations

import platform
from pathlib import Path

CONFIG = str(Path(__file__).resolve().parents[1] / "configs/duo_arithmetic.yaml")

# The default duo as it was when BENCHMARKS.md's training and rollout figures were measured (the
# main job has since moved to one-digit addition with a 32-token planner, 48-token replies and
# lr 5e-4; see docs/project/main-job.md, "The second example"): pinned so that the figures do not
# move with the main job's settings.
# Options given on a script's command line come after these and win.
PINNED = ["task.name=chain_sum", "task.options={min_terms: 2, max_terms: 3, min_digits: 1, max_digits: 1}",
          "team.max_new_tokens={}", "rollout.max_new_tokens=64", "rollout.temperature=0.7", "train.lr=1e-4",
          "train.eval_every=0", "eval.ablate=false", "eval.problems=64"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
