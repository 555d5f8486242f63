"""What an agent program of your own costs: the default duo played as a workflow (task.kind
workflow, examples/duo_workflow.py, through marft's OpenAI-compatible endpoint and the `openai`
client) against the same duo as marft's built-in team (task.kind dataset on the same records),
on the same engine, the same problems and the same sampling seeds, in one process.

    .venv/bin/python benchmarks/workflow.py                      # embedded model, 32 episodes, 3 rounds
    .venv/bin/python benchmarks/workflow.py --episodes 8 --rounds 1 model.name=DIR   # a smoke run

Two rows per path, rounds alternating between the paths (the first round of each is a warm-up and
not counted):
- replies as configs/workflow_duo.yaml has them (planner up to 32 tokens, solver 48): generated
  tokens per second of rollout wall time (prompts, generation, grading, and for the workflow the
  endpoint's start, HTTP and JSON);
- replies of one token: generation is then a small part, and (workflow seconds - built-in
  seconds) / calls is the endpoint's overhead per call (a server started per rollout included).
The two paths generate the same tokens (tests/test_workflow.py shows they are the same rollout),
which the script checks.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from marft.api import env_factory, prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.engines import make_engine  # noqa: E402
from marft.engines.machine import describe_machine  # noqa: E402
from marft.run.rollout import play  # noqa: E402

INSTRUCTION = "task.options={instruction: 'Give the final answer in \\boxed{}.'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="counted rounds per path and row (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = [f"rollout.episodes={args.episodes}", f"threads={args.threads}", *args.overrides]
    wf = load_config(ROOT / "configs/workflow_duo.yaml", base)
    team, models, make_wf = prepare(wf)
    built = load_config(ROOT / "configs/workflow_duo.yaml", [*base, "task.kind=dataset", INSTRUCTION])
    make_built = env_factory(built, team)
    engine = make_engine(wf, models)
    machine = describe_machine(next(iter(models.bases.values())))
    resets = [(1000 + e, {"split": "train"}) for e in range(args.episodes)]
    rows = []
    for label, limit in (("replies as configured", None), ("replies of one token", 1)):
        over = [] if limit is None else [f"rollout.max_new_tokens={limit}", f"team.max_new_tokens={{planner: {limit}}}"]
        cfgs = {"built-in team": load_config(ROOT / "configs/workflow_duo.yaml", [*base, "task.kind=dataset", INSTRUCTION, *over]),
                "workflow": load_config(ROOT / "configs/workflow_duo.yaml", [*base, *over])}
        team_of = {k: prepare_team(c) for k, c in cfgs.items()}
        envs = {"built-in team": make_built, "workflow": make_wf}
        got = {k: [] for k in cfgs}
        for r in range(args.rounds + 1):
            tokens = {}
            for path in cfgs:
                t0 = time.perf_counter()
                out = play(cfgs[path], team_of[path], engine, envs[path], resets, seed=r)
                seconds = time.perf_counter() - t0
                tokens[path] = [t.response_ids[m].tolist() for t in out.turns for m in [t.response_mask]]
                if r:
                    got[path].append((seconds, out.generated_tokens, sum(len(t.episodes) for t in out.turns)))
            same = tokens["built-in team"] == tokens["workflow"]
            if not same:
                print(f"warning: round {r} of '{label}': the two paths generated different tokens", file=sys.stderr)
        for path, runs in got.items():
            s = sum(x[0] for x in runs) / len(runs)
            rows.append((label, path, s, runs[0][1], runs[0][2]))
    print(f"# the duo ({wf.model.name}), {args.episodes} episodes, {machine['cpu']}, {machine['dtype']}, "
          f"{args.threads} threads; mean of {args.rounds} rounds after a warm-up")
    print("| replies | path | rollout s | generated tokens | calls | tokens/s | vs built-in | overhead per call ms |")
    print("|---|---|---|---|---|---|---|---|")
    for label in dict.fromkeys(r[0] for r in rows):
        mine = {r[1]: r for r in rows if r[0] == label}
        b = mine["built-in team"]
        for path, (_, _, s, tok, calls) in mine.items():
            ratio = (tok / s) / (b[3] / b[2]) if path != "built-in team" else 1.0
            over = f"{1000 * (s - b[2]) / calls:.1f}" if path != "built-in team" else "–"
            print(f"| {label} | {path} | {s:.2f} | {tok} | {calls} | {tok / s:.0f} | {ratio:.2f}x | {over} |")
    engine.close()
    return 0


def prepare_team(cfg):
    from marft.team import build_team

    return build_team(cfg.team)


if __name__ == "__main__":
    sys.exit(main())
