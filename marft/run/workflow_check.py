"""``marft env-check`` for an agent program (``task.kind: workflow``): play a few episodes of the
workflow against the team's endpoint, as a training rollout plays them, and report what happened.

Three ways to name the workflow, next to ``marft env-check dataset dataset=... reward=...``::

    marft env-check configs/workflow_duo.yaml model.name=tiny          # a config file + overrides
    marft env-check workflow workflow=examples/duo_workflow.py:duo dataset=examples/sums.jsonl \\
        reward=examples/duo_workflow.py:exact model.name=tiny          # task keys, config keys (dotted)
    marft env-check examples/duo_workflow.py:duo dataset=... reward=...  # the same, the workflow first

The model is the config's (``smollm2-135m`` by default); ``model.name=tiny`` checks the program in
seconds on a tiny random model that marft builds itself (its replies are noise: the check is of the
program's calls, not of its answers). ``--episodes N`` (default 4) episodes are played on problems
of the train split, at the run's sampling settings (``rollout.*``), through
:func:`marft.run.rollout.play`, the training rollout itself.

The report lists each episode: the calls it made (agents, in step order; calls issued together are
one step, listed in the team's order), the Flex-MG steps they became, its reward and answer, or why
it failed; then the time. Anything wrong is a finding, one line each, counted over episodes: the
workflow raised (the exception), called an agent the team does not have, called no agent, returned
nothing (None), did not end with the team's last agent, ran past ``rollout.env_timeout_s``, or its
reward function raised. Findings end the command with status 1 and one ``marft: error:`` line; what
stops it before any episode (a workflow that is no function of ``(problem, client)``, a missing
file, a bad config) is a :class:`marft.errors.UserError` (status 2).
"""
from __future__ import annotations

import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError

EPISODES = 4
"""Episodes ``marft env-check`` plays of a workflow unless ``--episodes`` says otherwise."""


def is_workflow_config(spec: str) -> bool:
    """``marft env-check SPEC``: SPEC is a config file (YAML), not an environment or a task kind."""
    return spec.lower().endswith((".yaml", ".yml"))


def looks_like_workflow(fn) -> bool:
    """``fn`` (what ``module:attr`` names) is meant as a workflow, ``workflow(problem, client)``:
    a function (not a class) that cannot be called as an environment factory
    (``factory(agents=..., answering=..., horizon=...)``); its own signature is checked later."""
    import inspect

    if isinstance(fn, type) or not callable(fn):
        return False
    if inspect.iscoroutinefunction(fn):
        return True
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    try:
        sig.bind(agents=[], answering=[], horizon=1)
        return False  # it takes what marft gives an environment factory
    except TypeError:
        return inspect.isfunction(fn) or inspect.ismethod(fn)


def workflow_config(spec: str, options: list[str]):
    """The run config of ``marft env-check SPEC OPTIONS`` (see the module docstring): for a config
    file the options are its overrides; for ``workflow`` (or a workflow's ``module:function``) an
    option without a dot is a key of the workflow task (``dataset=``, ``reward=``, ``workflow=``,
    ``prompt_column=``, ..., ``instruction=``), one with a dot a config key (``model.name=tiny``,
    ``team.preset=trio``)."""
    from .folder import config_file
    from .config import is_workflow, load_config
    from ..envs import WORKFLOW_KEYS

    if is_workflow_config(spec):
        cfg = load_config(config_file(spec, "env-check"), options)
        if not is_workflow(cfg):
            kinds = sorted({t.kind for t in (cfg.tasks or [cfg.task])})
            raise UserError(f"marft env-check {spec} runs a workflow (task.kind: workflow), but its task is "
                            f"{' + '.join(kinds)}{' (a mixture)' if cfg.tasks else ''}; check an environment with "
                            "marft env-check <task kind or module:Class> key=value ...")
        return cfg
    overrides = ["task.kind=workflow"] + ([] if spec == "workflow" else [f"task.workflow={spec}"])
    keys = (*WORKFLOW_KEYS, "horizon")
    for option in options:
        key, eq, value = option.partition("=")
        if not eq:
            raise UserError(f"env-check option {option!r} must look like key=value, e.g. dataset=data/train.jsonl")
        if "." in key:
            overrides.append(option)
        elif key == "instruction":
            overrides.append(f"task.options.instruction={value}")
        elif key in keys:
            overrides.append(f"task.{option}")
        else:
            raise UserError(f"env-check option {key!r} is not a key of a workflow task ({', '.join(keys)}, instruction); "
                            "give config keys with their section: model.name=tiny, team.preset=trio, rollout.max_new_tokens=32")
    cfg = load_config(None, overrides)
    missing = [k for k in ("workflow", "dataset", "reward") if not getattr(cfg.task, k)]
    if missing:
        raise UserError(f"marft env-check of a workflow needs {', '.join(k + '=...' for k in missing)}: the workflow "
                        "(path/to/file.py:function), its problems (a data set) and its reward function, as task.kind: "
                        "workflow takes them (or give a config file with task.kind: workflow)")
    return cfg


@dataclass
class Episode:
    """What one episode of the check did."""

    index: int
    problem: str = ""
    steps: list[list[str]] = field(default_factory=list)  # the agents of each step, in the team's order
    tokens: int = 0  # reply tokens of its calls
    truncated: int = 0  # of its calls, cut at their reply limit
    reward: float | None = None
    agent_rewards: dict[str, float] = field(default_factory=dict)
    success: bool = False
    answer: Any = None
    error: str | None = None

    @property
    def calls(self) -> list[str]:
        return [a for step in self.steps for a in step]


@dataclass
class WorkflowCheck:
    """The result of :func:`check_workflow_run`."""

    episodes: list[Episode]
    findings: list[str]  # one line each; [] when the workflow played every episode cleanly
    seconds: float
    gen_seconds: float
    tokens: int


def check_workflow_run(cfg, episodes: int = EPISODES) -> WorkflowCheck:
    """Play ``episodes`` episodes of ``cfg``'s workflow task, as training plays them, and say what
    happened (:class:`WorkflowCheck`). Raises :class:`UserError` for what stops it before any
    episode: the workflow, data set, reward function or model cannot be loaded."""
    from .assemble import prepare
    from ..engines import make_engine
    from .rollout import play

    if episodes < 1:
        raise UserError(f"--episodes must be at least 1, got {episodes}")
    team, models, make_env = prepare(cfg)  # the workflow, data and reward first: their errors come before the model's
    engine = make_engine(cfg, models)
    rng = random.Random(cfg.seed)
    resets = [(rng.randrange(2**62), {"split": "train"}) for _ in range(episodes)]  # as training draws them
    start = time.perf_counter()
    try:
        out = play(cfg, team, engine, make_env, resets, cfg.seed)
    finally:
        engine.close()
    seconds = time.perf_counter() - start
    names = list(team.names)
    eps = [Episode(e) for e in range(episodes)]
    for turn in out.turns:
        for row, e in enumerate(turn.episodes.tolist()):
            ep = eps[e]
            if not ep.problem:
                ep.problem = turn.states[row].removeprefix("Problem: ").split("\n[step ")[0]
            while len(ep.steps) <= turn.step:
                ep.steps.append([])
            ep.steps[turn.step].append(turn.agent)
            ep.tokens += int(turn.response_mask[row].sum())
            ep.truncated += bool(turn.truncated[row])
    for e, ep in enumerate(eps):
        info = out.infos[e] if e < len(out.infos) else {}
        ep.steps = [sorted(s, key=names.index) for s in ep.steps if s]
        ep.answer = info.get("answer")
        if bool(out.failed[e]):
            ep.error = info.get("error") or "failed"
            continue
        last = int(out.steps[e]) - 1
        ep.reward = float(out.rewards[e].sum())
        ep.agent_rewards = {a: float(out.agent_rewards[e, last, i]) for i, a in enumerate(names)}
        ep.success = bool(out.success[e])
    return WorkflowCheck(eps, findings(eps, names), seconds, out.gen_seconds,
                         sum(ep.tokens for ep in eps))


def reason(error: str, agents: list[str]) -> str:
    """An episode's failure as a finding: an endpoint's refusal (the client's exception) said in its
    own words, an unknown agent named as such; other reasons as they are."""
    error = " ".join(str(error).split())
    unknown = re.search(r"The model '([^']*)' does not exist", error)
    if unknown:
        return (f"the workflow called agent {unknown.group(1)!r}, which the team does not have (its agents: "
                f"{', '.join(agents)}); call the team's agents by name (model=...), or add the agent to team.agents")
    refused = re.match(r"the workflow raised (\w+): Error code: (\d+) - .*?'message': (['\"])(.*?)\3, '", error)
    if refused:
        kind, code, _, message = refused.groups()
        return f"the workflow raised {kind}: the endpoint refused a call ({code}: {message})"
    if error == "the workflow called no agent":
        return (f"the workflow called no agent; it must call the team's agents ({', '.join(agents)}) through the "
                "client it is given")
    return error[:400]


def findings(episodes: list[Episode], agents: list[str]) -> list[str]:
    """The distinct problems of the episodes, one line each, with how many episodes had them."""
    seen: dict[str, list[int]] = {}
    for ep in episodes:
        if ep.error is not None:
            seen.setdefault(reason(ep.error, agents), []).append(ep.index)
        elif ep.answer is None:
            seen.setdefault("the workflow returned None (no answer); return the answer to grade, e.g. the last "
                            f"agent's ({agents[-1]}) reply text", []).append(ep.index)
    n = len(episodes)
    return [f"{text} ({'every episode' if len(es) == n else f'{len(es)} of {n} episodes'})" for text, es in seen.items()]


def _short(text: Any, width: int = 60) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def format_check(result: WorkflowCheck, agents: list[str]) -> list[str]:
    """The report of a check, one line per episode and a summary (see the module docstring)."""
    lines = []
    for ep in result.episodes:
        head = f"  episode {ep.index}: {_short(ep.problem, 40) if ep.problem else ''}".rstrip()
        if ep.error is not None:
            calls = f" after {', '.join(ep.calls)}" if ep.calls else ""
            lines.append(f"{head}\n    failed{calls}: {reason(ep.error, agents)}")
            continue
        steps = " ".join(f"[{', '.join(s)}]" for s in ep.steps)
        per = ""
        if len(set(ep.agent_rewards.values())) > 1:
            per = " (" + ", ".join(f"{a} {r:.2f}" for a, r in ep.agent_rewards.items()) + ")"
        answer = "None (nothing returned)" if ep.answer is None else _short(ep.answer)
        cut = f", {ep.truncated} cut at their limit" if ep.truncated else ""
        lines.append(f"{head}\n    calls {', '.join(ep.calls)} -> {len(ep.steps)} step(s): {steps}\n"
                     f"    reward {ep.reward:.2f}{per}{' (solved)' if ep.success else ''}; answer {answer}; "
                     f"{ep.tokens} reply tokens{cut}")
    played = [ep for ep in result.episodes if ep.error is None]
    failed = len(result.episodes) - len(played)
    summary = (f"{len(result.episodes)} episodes in {result.seconds:.1f} s ({result.gen_seconds:.1f} s generating "
               f"{result.tokens} tokens): {len(played)} played, {failed} failed")
    if played:
        rewards = [ep.reward for ep in played]
        calls = [len(ep.calls) for ep in played]
        steps = [len(ep.steps) for ep in played]
        summary += (f"; mean reward {sum(rewards) / len(rewards):.2f}, calls per episode {_span(calls)}, "
                    f"steps {_span(steps)}")
    return lines + [summary]


def _span(xs: list[int]) -> str:
    """``3``, or ``2-5`` when the numbers differ."""
    return str(min(xs)) if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"


def main_check_workflow(spec: str, options: list[str], episodes: int = EPISODES) -> int:
    """``marft env-check`` of a workflow: print the report; 0 when every episode played cleanly,
    1 (one ``marft: error:`` line on stderr) when there are findings."""
    if episodes < 1:
        raise UserError(f"--episodes must be at least 1, got {episodes}")
    cfg = workflow_config(spec, options)
    t = cfg.task
    names = [a.name for a in cfg.team.agents]
    print(f"env-check: workflow {t.workflow} on {t.dataset} ({t.train_split} split), team {' -> '.join(names)}, "
          f"model {cfg.model.name}, {episodes} episode(s)", flush=True)
    result = check_workflow_run(cfg, episodes)
    for line in format_check(result, names):
        print(line)
    if not result.findings:
        print(f"env-check: workflow {t.workflow} played {episodes} episode(s) without a problem")
        return 0
    print(f"env-check: workflow {t.workflow} has {len(result.findings)} problem(s):")
    for f in result.findings:
        print(f"  - {f}")
    more = f"; {len(result.findings) - 1} more problem(s) listed above" if len(result.findings) > 1 else ""
    print(f"marft: error: workflow {t.workflow}: {result.findings[0]}{more}; fix it and run marft env-check again",
          file=sys.stderr)
    return 1
