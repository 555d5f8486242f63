"""The team as a Flexible Markov Game: agent profiles, the dependency graph D, presets, and the
chat messages each agent sees.

Within one environment step agents act in a topological order of D. Agent i sees the
environment's observation plus the replies of its predecessors (every j with D(i, j) = 1) from
the same step. ``chain`` (the default) lets every agent see all earlier ones; ``parallel`` lets
nobody see anybody; a mapping ``{agent: [agents it sees]}`` gives any DAG.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass

from .errors import UserError

SHARED_ADAPTER = "team"
SIMPLE_NAME = re.compile(r"[A-Za-z0-9_-]+")
"""What agent and adapter names may hold: they name folders (``<run>/checkpoints/.../adapters/<adapter>``,
``eval_final_without_<agent>.json``) and PEFT modules, so letters, digits, '_' and '-' only."""

_ROLE_PROMPTS = {
    "planner": "You are the planner of a team that solves problems together. Read the problem and "
    "write a short plan of the steps that solve it. Do not carry out the plan yourself.",
    "solver": "You are the solver of a team that solves problems together. Solve the problem step "
    "by step, following your teammates' plan if there is one.",
    "verifier": "You are the verifier of a team that solves problems together. Check your teammates' "
    "solution step by step, correct it if it is wrong, and state the final answer.",
    "reflector": "You are the reflector of a team that solves problems together. Point out any "
    "mistake in your teammates' solution and say how to fix it. Do not give a final answer.",
    "coder": "You are the coder of a team that writes Python programs together. Write a correct, "
    "complete Python function for the task, following your teammates' plan if there is one.",
    "speaker": "You are a member of a team that solves problems together. You know a part of the "
    "problem that your teammates do not. Tell them exactly what your instructions say, nothing else.",
    "tester": "You are the tester of a team that writes Python programs together. Check the coder's "
    "function against the task and its tests case by case, then give the final complete function: "
    "the coder's if it is correct, corrected if it is not.",
}

# preset -> (name, answers); the name's role prompt is that of the name without trailing digits
PRESETS = {
    "solo": [("solver", True)],
    "duo": [("planner", False), ("solver", True)],
    "trio": [("planner", False), ("solver", True), ("verifier", True)],
    "quartet": [("planner", False), ("solver", True), ("reflector", False), ("verifier", True)],
    # cooperative tasks (task.kind: coop): speakers hold parts of the problem, the solver answers
    "coop2": [("speaker", False), ("solver", True)],
    "coop3": [("speaker1", False), ("speaker2", False), ("solver", True)],
    "coop4": [("speaker1", False), ("speaker2", False), ("speaker3", False), ("solver", True)],
    "code-solo": [("coder", True)],
    "code-duo": [("coder", True), ("tester", True)],
    "code-trio": [("planner", False), ("coder", True), ("tester", True)],
}


def preset_agents(preset: str) -> list[dict]:
    """The agents of a preset as config data; ``<preset>-anon`` gives anonymous roles."""
    anon = preset.endswith("-anon")
    base = preset[: -len("-anon")] if anon else preset
    if base not in PRESETS:
        names = ", ".join(list(PRESETS) + [p + "-anon" for p in PRESETS])
        raise UserError(f"config: unknown team.preset {preset!r}; choose one of {names}, or list team.agents yourself")
    roles = PRESETS[base]
    n = len(roles)
    if anon:
        return [
            {"name": f"agent{k + 1}", "answers": answers,
             "prompt": f"You are agent {k + 1} of {n} in a team that solves problems together."}
            for k, (_, answers) in enumerate(roles)
        ]
    return [{"name": role, "prompt": _ROLE_PROMPTS[role.rstrip("0123456789")], "answers": answers}
            for role, answers in roles]


@dataclass(frozen=True)
class Agent:
    name: str
    prompt: str
    answers: bool
    adapter: str  # the LoRA adapter it acts with and trains
    model: str  # its base model ("" = the team's)
    sees: tuple[str, ...]  # its predecessors in D, in acting order
    max_new_tokens: int = 0  # its longest reply; 0 = the rollout's


@dataclass(frozen=True)
class Team:
    agents: tuple[Agent, ...]  # in acting (topological) order
    left_out: tuple[str, ...] = ()  # agents an ablation left out (:meth:`without`)
    _order: tuple[str, ...] = ()  # the whole team's acting order, where agents were left out

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.agents]

    @property
    def whole(self) -> list[str]:
        """The names of the whole team before any agent was left out, in acting order (a task
        that gives each agent a part of the problem still deals every part)."""
        if not self.left_out:
            return self.names
        return [n for n in self._order if n in self.names or n in self.left_out]

    @property
    def answering(self) -> list[str]:
        return [a.name for a in self.agents if a.answers]

    @property
    def adapters(self) -> list[str]:
        """Distinct adapter names, in first-use order."""
        return list(dict.fromkeys(a.adapter for a in self.agents))

    def without(self, names) -> "Team":
        """The team with the agents ``names`` left out: they do not act and nobody sees their
        messages (the others keep their prompts and adapters). For ablations: what an agent adds."""
        for n in names:
            self[n]  # an unknown name is a UserError
        left = tuple(dataclasses.replace(a, sees=tuple(m for m in a.sees if m not in names))
                     for a in self.agents if a.name not in names)
        out = tuple(n for n in self.whole if n in names or n in self.left_out)
        if not left:
            raise UserError(f"leaving out {', '.join(names)} leaves no agent in the team")
        if not any(a.answers for a in left):
            raise UserError(f"leaving out {', '.join(names)} leaves no answering agent; leave out another agent")
        return Team(left, out, tuple(self.whole))

    def __getitem__(self, name: str) -> Agent:
        for a in self.agents:
            if a.name == name:
                return a
        raise UserError(f"unknown agent {name!r}; the team has {', '.join(self.names)}")


def build_team(cfg) -> Team:
    """Resolve a :class:`marft.run.config.TeamConfig` into a :class:`Team`; raises UserError on a bad
    team (no agents, a name twice, an unknown name in the graph, a cycle)."""
    agents = list(cfg.agents)
    if not agents:
        raise UserError("config: team.agents is empty; give at least one agent or a team.preset such as duo")
    names = [a.name for a in agents]
    for i, n in enumerate(names):
        if not n:
            raise UserError(f"config: team.agents.{i}.name is empty; every agent needs a unique name")
        _check_simple_name(n, f"team.agents.{i}.name")
        if names.count(n) > 1:
            raise UserError(f"config: agent name {n!r} is used twice in team.agents; names must be unique")
        if agents[i].adapter:
            _check_simple_name(agents[i].adapter, f"team.agents.{i}.adapter")
        if (agents[i].adapter or n) == "default" and not cfg.share_adapter:
            raise UserError(f"config: team.agents.{i} would train an adapter named 'default', the name PEFT keeps for its own "
                            f"(it saves that adapter outside the adapter's folder, where no checkpoint finds it); rename "
                            f"the agent, or give its adapter another name: team.agents.{i}.adapter=...")
    graph = cfg.graph
    if graph == "chain":
        sees = {n: names[:i] for i, n in enumerate(names)}
    elif graph in ("parallel", None, {}):
        sees = {n: [] for n in names}
    elif isinstance(graph, dict):
        sees = {n: [] for n in names}
        for k, v in graph.items():
            if k not in sees:
                raise UserError(f"config: team.graph names agent {k!r}, which is not in team.agents ({', '.join(names)})")
            v = [v] if isinstance(v, str) else v
            if v is None:
                v = []
            if not isinstance(v, list) or not all(isinstance(j, str) for j in v):
                raise UserError(f"config: team.graph.{k} must be a list of the agent names it sees, e.g. "
                                f"team.graph={{{k}: [{next((m for m in names if m != k), k)}]}}, got {v!r}")
            for j in v:
                if j not in sees:
                    raise UserError(f"config: team.graph.{k} names agent {j!r}, which is not in team.agents ({', '.join(names)})")
                if j == k:
                    raise UserError(f"config: team.graph.{k} lists itself; an agent cannot see its own reply of the same step")
            sees[k] = v
    else:
        raise UserError(f"config: team.graph must be chain, parallel or a mapping {{agent: [agents it sees]}}, got {graph!r}")
    order = _topological_order(names, sees)
    if not any(a.answers for a in agents):
        agents[-1] = dataclasses.replace(agents[-1], answers=True)
    by_name = {a.name: a for a in agents}
    limits = dict(cfg.max_new_tokens or {})
    for n, v in limits.items():
        close = difflib.get_close_matches(n, names, n=1, cutoff=0.75)
        if n not in by_name and close:  # a misspelt name; a name of another team is left alone
            raise UserError(f"config: team.max_new_tokens names agent {n!r}, which is not in the team "
                            f"({', '.join(names)}); did you mean {close[0]!r}?")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"config: team.max_new_tokens.{n} must be a positive number of tokens, got {v!r}")
    out = []
    for n in order:
        a = by_name[n]
        adapter = SHARED_ADAPTER if cfg.share_adapter else (a.adapter or a.name)
        seen = tuple(m for m in order if m in sees[n])
        out.append(Agent(n, a.prompt, bool(a.answers), adapter, a.model, seen, limits.get(n, 0)))
    return Team(tuple(out))


def _check_simple_name(name, where: str) -> None:
    if not isinstance(name, str) or not SIMPLE_NAME.fullmatch(name):
        raise UserError(f"config: {where} {name!r} is not a simple name; use only letters, digits, '_' and '-' "
                        "(it names the agent's adapter folder)")


def _topological_order(names: list[str], sees: dict[str, list[str]]) -> list[str]:
    """Kahn's algorithm, keeping the listed order among agents that are free to act."""
    left = list(names)
    done: list[str] = []
    while left:
        ready = [n for n in left if all(p in done for p in sees[n])]
        if not ready:
            raise UserError(f"config: team.graph has a cycle among {', '.join(left)}; agents within a step must form a DAG")
        done.append(ready[0])
        left.remove(ready[0])
    return done


def agent_messages(agent: Agent, observation: str, replies: dict[str, str]) -> list[dict]:
    """The chat an agent answers: its system prompt, then one user message with the environment's
    observation and the replies of exactly the agents it sees (``replies`` may hold more)."""
    user = observation
    seen = [(n, replies[n]) for n in agent.sees if n in replies]
    if seen:
        user += "\n\nMessages from your teammates:\n" + "\n\n".join(f"[{n}]\n{t.strip()}" for n, t in seen)
    msgs = [{"role": "system", "content": agent.prompt}] if agent.prompt else []
    return msgs + [{"role": "user", "content": user}]
