"""Evaluation: the team on held-out problems, k samples each with a fixed seed, summarised as a
table (team accuracy = pass@1 with a 95% interval, pass@k for k samples, the share of problems
solved by each turn of a multi-turn task, answer-extraction rate, reply length per agent, tokens/s)
and as JSON."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from .engines import make_engine
from .generation import Sampling
from .models import TeamModel
from .rollout import rollout


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    return _wilson(successes / n, n, z)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) of one problem with n samples of which c are correct:
    1 - C(n-c, k) / C(n, k), the chance that at least one of k samples drawn without replacement is."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def accuracy_interval(success: torch.Tensor, z: float = 1.96) -> tuple[float, float, float]:
    """Mean accuracy and 95% interval from a [problems, samples] table of 0/1 (or per-sample scores).

    One sample per problem: Wilson interval. Several: the problems are the independent units. The
    standard error of the per-problem means gives an effective sample size, n_eff = p(1 - p) / se^2
    (the number of independent 0/1 draws with the same standard error, at most problems x samples),
    and the interval is Wilson's at n_eff. Where the per-problem means carry no spread to estimate it
    from (all 0 or all 1), n_eff is the number of problems. Unlike mean +- z se, the interval is never
    a single point and stays inside [0, 1]."""
    n, k = success.shape
    mean = float(success.float().mean())
    if k == 1:
        lo, hi = wilson_interval(int(success.sum()), n, z)
        return mean, lo, hi
    se = float(success.float().mean(1).std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
    n_eff = min(mean * (1 - mean) / se**2, n * k) if se > 0 and 0 < mean < 1 else float(n)
    lo, hi = _wilson(mean, n_eff, z)
    return mean, lo, hi


def _wilson(p: float, n: float, z: float) -> tuple[float, float]:
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate(cfg, team, models, make_env, num_problems: int | None = None, progress=None) -> dict:
    """Run the team on the first ``eval.problems`` test problems (fewer if the split is smaller),
    ``eval.samples`` times each, ``rollout.episodes`` at a time. ``models`` is an engine
    (:mod:`marft.engines`) or a :class:`TeamModel` (then the engine ``rollout.engine`` names is
    built for this evaluation and closed after it). ``progress(done, total, tokens)`` is called
    after every agent turn."""
    if isinstance(models, TeamModel):
        engine = make_engine(cfg, models)
        try:
            return evaluate(cfg, team, engine, make_env, num_problems, progress)
        finally:
            engine.close()
    ev, ro = cfg.eval, cfg.rollout
    n = min(ev.problems, num_problems) if num_problems else ev.problems
    k = ev.samples
    sampling = Sampling(ev.temperature, ro.top_p, ro.top_k, ro.max_new_tokens, tuple(ro.stop))
    generator = torch.Generator().manual_seed(ev.seed)
    resets = [(ev.seed + i, {"split": "test", "index": i}) for i in range(n) for _ in range(k)]
    success = torch.zeros(n * k, dtype=torch.bool)
    extracted = torch.zeros(n * k, dtype=torch.bool)
    reward = torch.zeros(n * k)
    steps = torch.zeros(n * k)
    failed = torch.zeros(n * k, dtype=torch.bool)
    errors: list[str] = []
    lengths: dict[str, list[float]] = {a: [] for a in team.names}
    truncated: dict[str, list[float]] = {a: [] for a in team.names}
    kept = {i * k: i for i in range(min(ev.transcripts, n))}  # episode -> problem, first sample only
    transcripts: dict[int, dict] = {}
    texts: set[str] = set()  # each problem's opening state (every agent's part of it): distinct problems
    tokens, gen_seconds, start = 0, 0.0, time.perf_counter()
    done_eps = 0
    for lo in range(0, n * k, ro.episodes):
        chunk = resets[lo:lo + ro.episodes]

        def on_turn(turn):
            nonlocal tokens
            tokens += int(turn.response_mask.sum())
            if progress:
                progress(done_eps, n * k, tokens)

        out = rollout(team, models, make_env, chunk, sampling, cfg.task.horizon, generator, on_turn, ro.env_timeout_s,
                      schedule=ro.schedule)
        failed[lo:lo + len(chunk)] = out.failed
        errors += [i["error"] for i, f in zip(out.infos, out.failed.tolist()) if f]
        hi = lo + len(chunk)
        success[lo:hi], extracted[lo:hi] = out.success, out.extracted
        reward[lo:hi] = out.rewards.sum(1)
        steps[lo:hi] = out.steps.float()
        here = {e - lo for e in kept if lo <= e < hi}  # this chunk's episodes whose transcript is kept
        for t in out.turns:
            for row, e in enumerate(t.episodes.tolist()):
                if e in here:
                    rec = transcripts.setdefault(lo + e, {"problem": kept[lo + e], "observation": t.states[row], "turns": []})
                    rec["turns"].append({"step": t.step, "agent": t.agent, "reply": t.texts[row],
                                         "truncated": bool(t.truncated[row])})
            if t.step == 0 and t.agent == team.names[0]:
                texts.update(t.states)
            lengths[t.agent] += t.response_mask.sum(1).float().tolist()
            truncated[t.agent] += t.truncated.float().tolist()
        for e in here:  # an episode that failed before its first turn has a transcript without turns
            rec = transcripts.setdefault(lo + e, {"problem": kept[lo + e], "observation": None, "turns": []})
            rec.update(correct=bool(out.success[e]), answer=out.infos[e].get("answer"), error=out.infos[e].get("error"))
        gen_seconds += out.gen_seconds
        done_eps = hi
        if progress:
            progress(done_eps, n * k, tokens)
    seconds = time.perf_counter() - start
    acc, ci_lo, ci_hi = accuracy_interval(success.view(n, k))
    correct = success.view(n, k).sum(1).tolist()
    ks = sorted({j for j in (1, 2, 5, 10, k) if j <= k})
    solved_at = steps.view(n, k)[success.view(n, k)]  # the turn at which each success came
    return {
        "problems": n,
        "distinct_problems": len(texts),  # held-out problems that are distinct texts (a small task repeats some)
        "samples": k,
        "accuracy": acc,
        "ci95": [ci_lo, ci_hi],
        "pass_at_k": {str(j): sum(pass_at_k(k, int(c), j) for c in correct) / n for j in ks},
        "solved_by_turn": [float((solved_at <= t).sum()) / (n * k) for t in range(1, cfg.task.horizon + 1)],
        "extraction_rate": float(extracted.float().mean()),
        "failed_episodes": int(failed.sum()),  # the environment raised or timed out; counted as unsolved
        "first_errors": errors[:5],
        "mean_reward": float(reward.mean()),
        "mean_steps": float(steps.mean()),
        "agents": {a: {"mean_tokens": _mean(lengths[a]), "truncated": _mean(truncated[a])} for a in team.names},
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "temperature": ev.temperature,
        "seed": ev.seed,
        "per_problem_success": success.view(n, k).float().mean(1).tolist(),
        "transcripts": [transcripts[e] for e in sorted(transcripts)],
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def format_table(result: dict, title: str = "evaluation"):
    """A rich Table of an evaluation result."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    lo, hi = result["ci95"]
    table.add_row("problems x samples", f"{result['problems']} x {result['samples']}")
    if "distinct_problems" in result:
        table.add_row("distinct problem texts", str(result["distinct_problems"]))
    table.add_row("team accuracy (pass@1)", f"{100 * result['accuracy']:.1f}%  (95% CI {100 * lo:.1f}-{100 * hi:.1f})")
    for j, v in result.get("pass_at_k", {}).items():
        if j != "1" or result["samples"] > 1:
            table.add_row(f"pass@{j}", f"{100 * v:.1f}%")
    by_turn = result.get("solved_by_turn", [])
    if len(by_turn) > 1:
        table.add_row("solved by turn 1, 2, ...", ", ".join(f"{100 * v:.1f}%" for v in by_turn))
    table.add_row("answer extracted", f"{100 * result['extraction_rate']:.1f}%")
    if result.get("failed_episodes"):
        table.add_row("episodes failed in the environment", f"{result['failed_episodes']} (counted unsolved; first: "
                      f"{result['first_errors'][0][:80]})")
    table.add_row("mean reward", f"{result['mean_reward']:.3f}")
    for agent, a in result["agents"].items():
        table.add_row(f"{agent}: mean reply tokens", f"{a['mean_tokens']:.1f}  ({100 * a['truncated']:.0f}% cut)")
    table.add_row("generated tokens/s", f"{result['tokens_per_s']:.1f}")
    table.add_row("wall time", f"{result['seconds']:.1f} s")
    return table


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
