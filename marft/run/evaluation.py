"""Evaluation: the team on held-out problems, k samples each with a fixed seed, summarised as a
table (team accuracy = pass@1 with a 95% interval, pass@k for k samples, the share of problems
solved by each turn of a multi-turn task, answer-extraction rate, reply length per agent, tokens/s)
and as JSON."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..engines import make_engine
from ..engines.generation import Sampling
from ..engines.models import TeamModel
from ..maths.stats import accuracy_interval, macro_interval, pass_at_k
from .rollout import episode_runner


def evaluate(cfg, team, models, make_env, num_problems: int | None = None, progress=None, critic=None) -> dict:
    """Run the team on the first ``eval.problems`` test problems (fewer if the split is smaller),
    ``eval.samples`` times each, ``rollout.episodes`` at a time. ``models`` is an engine
    (:mod:`marft.engines`) or a :class:`TeamModel` (then the engine ``rollout.engine`` names is
    built for this evaluation and closed after it). ``progress(done, total, tokens)`` is called
    after every agent turn. ``critic`` (a :class:`CriticCheck`) sees every batch of episodes and
    its summary goes under ``critic``: how well a trained critic predicts the held-out returns.

    A mixture of tasks (``make_env`` a :class:`marft.envs.mixture.MixtureFactory` of several) is
    scored on every task's own first ``eval.problems`` held-out problems, each task in batches of its
    own from the same sampling seed (so a task scores as it would evaluated alone, given the same
    weights): the result holds a result per task under ``tasks`` (each as a single task's), and at
    its top the macro mean over tasks
    (``accuracy``, its ``ci95`` by :func:`marft.maths.stats.macro_interval`; ``micro_accuracy``
    over all episodes); the other top figures are over all episodes."""
    if isinstance(models, TeamModel):
        engine = make_engine(cfg, models)
        try:
            return evaluate(cfg, team, engine, make_env, num_problems, progress, critic)
        finally:
            engine.close()
    from .config import horizon as run_horizon
    from ..envs.mixture import MixtureFactory

    ev, ro = cfg.eval, cfg.rollout
    k = ev.samples
    if isinstance(make_env, MixtureFactory):  # (task, problems, horizon) of each task
        parts = [(label, min(ev.problems, make_env.problems[label] or ev.problems), make_env.horizons[label])
                 for label in make_env.labels]
    else:
        parts = [(None, min(ev.problems, num_problems) if num_problems else ev.problems, run_horizon(cfg))]
    sampling = Sampling(ev.temperature, ro.top_p, ro.top_k, ro.max_new_tokens, tuple(ro.stop))
    resets, slices, kept = [], [], {}  # kept: episode -> problem, first sample of the first eval.transcripts problems
    for task, n, _ in parts:
        kept.update({len(resets) + i * k: i for i in range(min(ev.transcripts, n))})
        slices.append(range(len(resets), len(resets) + n * k))
        resets += [(ev.seed + i, {"split": "test", "index": i, **({"task": task} if task else {})}) for i in range(n) for _ in range(k)]
    total = len(resets)
    rec = _Record(total)
    tokens, start = 0, time.perf_counter()
    done_eps = 0
    # rollout.schedule async needs an engine with a request queue (vLLM); on Ray the driver evaluates
    # with the HF engine, which plays the same episodes turn by turn
    schedule = ro.schedule if getattr(models, "asynchronous", False) else "barrier"
    for sl, (_, _, h) in zip(slices, parts):
        # each task from the same sampling seed, in batches of its own: its result is the one it gets evaluated alone
        generator = torch.Generator().manual_seed(ev.seed)
        for lo in range(sl.start, sl.stop, ro.episodes):
            chunk = resets[lo:min(lo + ro.episodes, sl.stop)]

            def on_turn(turn):
                nonlocal tokens
                tokens += int(turn.response_mask.sum())
                if progress:
                    progress(done_eps, total, tokens)

            out = episode_runner(cfg)(team, models, make_env, chunk, sampling, h, generator, on_turn, ro.env_timeout_s,
                                  schedule=schedule)
            rec.add(lo, out, kept)
            if critic is not None:  # its passes timed apart: the figures above are the team's alone
                t_critic = time.perf_counter()
                critic.add(out)
                start += time.perf_counter() - t_critic
            done_eps = lo + len(chunk)
            if progress:
                progress(done_eps, total, tokens)
    seconds = time.perf_counter() - start
    results = [rec.summary(sl, n, k, h, team.names) for sl, (_, n, h) in zip(slices, parts)]
    overall = results[0] if len(parts) == 1 else rec.summary(range(total), total // k, k, run_horizon(cfg), team.names)
    overall.update(generated_tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
                   temperature=ev.temperature, seed=ev.seed)
    if len(parts) > 1:
        overall["micro_accuracy"], overall["micro_ci95"] = overall["accuracy"], overall["ci95"]
        overall["accuracy"] = sum(r["accuracy"] for r in results) / len(results)
        overall["ci95"] = macro_interval(results)
        overall["tasks"] = {task: r for (task, _, _), r in zip(parts, results)}
        for task, r in overall["tasks"].items():
            for t in r["transcripts"]:  # the same records as the top's: each says its task
                t["task"] = task
    if critic is not None:
        overall["critic"] = critic.summary()
    return overall


class CriticCheck:
    """How well a trained critic (a checkpoint's value heads, :func:`marft.run.checkpoints.read_critic`,
    with its adapter for ``train.critic: lora``) predicts the returns of held-out episodes: per head
    (``"team"``, or an agent's for IPPO) the explained variance, the mean squared error, the mean
    value and the mean return over its entries (turns; at token level reply tokens). The returns are
    the discounted returns the episodes got (``train.gamma``, λ = 1: no value of a later state in
    them), the values those of :attr:`algorithm`'s targets, as in training."""

    def __init__(self, cfg, team_names: list[str], models, heads: dict, algorithm, adapter: str | None, source: str):
        import dataclasses

        self.train = dataclasses.replace(cfg.train, lam=1.0)
        self.names, self.models, self.heads, self.algorithm, self.adapter = team_names, models, heads, algorithm, adapter
        self.source = source
        self.got: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {key: [] for key in heads}
        self.seconds = 0.0

    def add(self, out) -> None:
        """Score the critic on a batch's episodes; those whose environment failed are left out, as
        training leaves them out (their reward is 0 whatever was said)."""
        from ..engines.packing import PassWork
        from ..maths.algorithms import TargetInputs
        from .trainer import head_entries

        t0 = time.perf_counter()
        if out.failed.any():
            if out.failed.all():
                return
            out = out.select(~out.failed)
        if not out.turns:
            return
        with torch.no_grad():
            targets = self.algorithm.targets(TargetInputs(self.train, self.names, self.models, self.heads, PassWork(),
                                                          self.adapter), out)
        for key in self.heads:
            self.got[key].append(head_entries(out, targets, key, self.algorithm.token_level))
        self.seconds += time.perf_counter() - t0

    def summary(self) -> dict:
        from ..maths.stats import explained_variance

        heads = {}
        for key, parts in self.got.items():
            ret = torch.cat([r for r, _ in parts]).double() if parts else torch.zeros(0, dtype=torch.float64)
            val = torch.cat([v for _, v in parts]).double() if parts else torch.zeros(0, dtype=torch.float64)
            heads[key] = {"entries": len(ret), "explained_variance": explained_variance(ret, val),
                          "mse": float(((ret - val) ** 2).mean()) if len(ret) else None,
                          "mean_value": float(val.mean()) if len(ret) else None,
                          "mean_return": float(ret.mean()) if len(ret) else None}
        return {"checkpoint": self.source, "kind": "lora" if self.adapter else "head",
                "algorithm": self.algorithm.name, "heads": heads, "seconds": self.seconds}


def critic_check(cfg, team, models, checkpoint: Path) -> CriticCheck | None:
    """The :class:`CriticCheck` of the critic saved in ``checkpoint`` (its ``critic/`` folder), or
    None where it has none. A learning critic's adapter (``adapters/<adapter>`` of the checkpoint) is
    added to ``models`` and loaded; a one-line error when the critic does not fit the team."""
    from ..errors import UserError
    from ..maths.algorithms import ALGORITHMS
    from .checkpoints import load_heads, read_critic

    found = read_critic(checkpoint)
    if found is None:
        return None
    about, states = found
    algorithm = ALGORITHMS.get(about.get("algorithm"))
    widths = about["heads"]
    want = set(algorithm.make_heads(team.names, 1)) if algorithm else set()
    if not want or want != set(widths) or (about.get("team") or team.names) != team.names:
        raise UserError(f"the critic in {checkpoint} was trained by {about.get('algorithm')} for team "
                        f"{', '.join(about.get('team') or widths)}, which does not fit the team {', '.join(team.names)}; "
                        "evaluate with the config it was trained with (or --no-critic)")
    heads = algorithm.make_heads(team.names, {a: widths["team"] if "team" in widths else widths[a] for a in team.names})
    load_heads(heads, states, f"the critic in {checkpoint / 'critic'} does not fit the team's models",
               "evaluate with the config it was trained with")
    for head in heads.values():
        head.eval()
    adapter = about.get("adapter")
    if adapter:
        models.add_critic_adapter(adapter)
        models.load_adapter(adapter, checkpoint / "adapters" / adapter)
    return CriticCheck(cfg, team.names, models, heads, algorithm, adapter, str(checkpoint))


class _Record:
    """What an evaluation's episodes gave, episode by episode (``add`` each rollout of a chunk)."""

    def __init__(self, total: int):
        self.success = torch.zeros(total, dtype=torch.bool)
        self.extracted = torch.zeros(total, dtype=torch.bool)
        self.reward = torch.zeros(total)
        self.steps = torch.zeros(total)
        self.failed = torch.zeros(total, dtype=torch.bool)
        self.errors: dict[int, str] = {}
        self.rows: list[tuple[int, str, float, float]] = []  # (episode, agent, reply tokens, cut)
        self.openings: dict[int, str] = {}  # episode -> the state before its first micro-step (the problem): distinct problems
        self.transcripts: dict[int, dict] = {}

    def add(self, lo: int, out, kept: dict[int, int]) -> None:
        hi = lo + len(out.steps)
        self.failed[lo:hi] = out.failed
        self.errors.update({lo + e: i["error"] for e, (i, f) in enumerate(zip(out.infos, out.failed.tolist())) if f})
        self.success[lo:hi], self.extracted[lo:hi] = out.success, out.extracted
        self.reward[lo:hi] = out.rewards.sum(1)
        self.steps[lo:hi] = out.steps.float()
        here = {e - lo for e in kept if lo <= e < hi}  # this chunk's episodes whose transcript is kept
        for t in out.turns:
            lengths, cut = t.response_mask.sum(1).float().tolist(), t.truncated.float().tolist()
            for row, e in enumerate(t.episodes.tolist()):
                self.rows.append((lo + e, t.agent, lengths[row], cut[row]))
                if lo + e not in self.openings:  # the turns come in micro-step order: the episode's first
                    self.openings[lo + e] = t.states[row]  # (whichever agent acted first, as in an agent program)
                if e in here:
                    rec = self.transcripts.setdefault(lo + e, {"problem": kept[lo + e], "observation": t.states[row], "turns": []})
                    turn = {"step": t.step, "agent": t.agent, "reply": t.texts[row], "truncated": bool(t.truncated[row])}
                    if t.messages is not None and t.messages[row] is not None:  # an agent program's: what it sent
                        turn["messages"] = t.messages[row]
                    rec["turns"].append(turn)
        for e in here:  # an episode that failed before its first turn has a transcript without turns
            rec = self.transcripts.setdefault(lo + e, {"problem": kept[lo + e], "observation": None, "turns": []})
            rec.update(correct=bool(out.success[e]), answer=out.infos[e].get("answer"), error=out.infos[e].get("error"))

    def summary(self, sl: range, n: int, k: int, horizon: int, agents: list[str]) -> dict:
        """The result of the episodes ``sl`` (n problems x k samples, in that order)."""
        idx = slice(sl.start, sl.stop)
        success = self.success[idx].view(n, k)
        acc, ci_lo, ci_hi = accuracy_interval(success)
        correct = success.sum(1).tolist()
        ks = sorted({j for j in (1, 2, 5, 10, k) if j <= k})
        solved_at = self.steps[idx].view(n, k)[success]  # the turn at which each success came
        rows = [r for r in self.rows if r[0] in sl]
        tokens = sum(int(r[2]) for r in rows)
        return {
            "problems": n,
            "distinct_problems": len({self.openings[e] for e in sl if e in self.openings}),  # held-out problems that are distinct texts
            "samples": k,
            "accuracy": acc,
            "ci95": [ci_lo, ci_hi],
            "pass_at_k": {str(j): sum(pass_at_k(k, int(c), j) for c in correct) / n for j in ks},
            "solved_by_turn": [float((solved_at <= t).sum()) / (n * k) for t in range(1, horizon + 1)],
            "extraction_rate": float(self.extracted[idx].float().mean()),
            "failed_episodes": int(self.failed[idx].sum()),  # the environment raised or timed out; counted as unsolved
            "first_errors": [self.errors[e] for e in sl if e in self.errors][:5],
            "mean_reward": float(self.reward[idx].mean()),
            "mean_steps": float(self.steps[idx].float().mean()),
            "agents": {a: {"mean_tokens": _mean([r[2] for r in rows if r[1] == a]),
                           "truncated": _mean([r[3] for r in rows if r[1] == a])} for a in agents},
            "generated_tokens": tokens,
            "per_problem_success": success.float().mean(1).tolist(),
            "transcripts": [self.transcripts[e] for e in sorted(self.transcripts) if e in sl],
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
    tasks = result.get("tasks") or {}
    mean = f" macro mean of {len(tasks)} tasks" if tasks else ""
    table.add_row(f"team accuracy (pass@1){mean}", f"{100 * result['accuracy']:.1f}%  (95% CI {100 * lo:.1f}-{100 * hi:.1f})")
    for task, r in tasks.items():
        tl, th = r["ci95"]
        table.add_row(f"  {task} ({r['problems']} problems)", f"{100 * r['accuracy']:.1f}%  (95% CI {100 * tl:.1f}-{100 * th:.1f})")
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
    for key, h in (result.get("critic") or {}).get("heads", {}).items():
        name = "critic" if key == "team" else f"critic of {key}"
        ev = "-" if h["explained_variance"] is None else f"{h['explained_variance']:.3f}"
        if h["entries"]:
            table.add_row(f"{name}: explained variance, mean value / return",
                          f"{ev}, {h['mean_value']:.3f} / {h['mean_return']:.3f}")
    table.add_row("generated tokens/s", f"{result['tokens_per_s']:.1f}")
    table.add_row("wall time", f"{result['seconds']:.1f} s")
    return table


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
