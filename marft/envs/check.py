"""``marft env-check``: does an environment follow the protocol of :mod:`marft.envs.base`?

:func:`check_env` plays a few short episodes with a two-agent team (``alice`` then ``bob``, ``bob``
answers, horizon 2) and fixed wrong replies, and returns what it found wrong, one line each, e.g.
``observe('bob') returned int, expected str``. An exception raised by the environment becomes one
such line (its type and message) and stops the checks that depend on it. It checks behaviour through
the public API only; it cannot tell whether an environment grades correctly.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import sys
from functools import partial
from typing import Any, Callable

from marft.errors import UserError

AGENTS, ANSWERING, HORIZON = ["alice", "bob"], ["bob"], 2


def _wrong_reply(agent: str, t: int) -> str:
    """A reply no task should accept, with a marker that ``state()`` must show."""
    return f"<{agent} turn {'abcdefgh'[t]} marker> I am not sure; I give up."  # no digits: no number to read


def _name(x: Any) -> str:
    return type(x).__name__


class _Checks:
    def __init__(self):
        self.problems: list[str] = []
        self.count = 0

    def expect(self, ok: bool, problem: str) -> bool:
        self.count += 1
        if not ok:
            self.problems.append(problem)
        return ok

    def call(self, what: str, fn: Callable, *args, **kwargs) -> tuple[bool, Any]:
        """Run ``fn``; an exception becomes the problem '<what> raised <Type>: <message>'."""
        self.count += 1
        try:
            return True, fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - reporting the user's exception is the point
            self.problems.append(f"{what} raised {_name(e)}: {' '.join(str(e).split())}".strip())
            return False, None


def _is_real(x: Any) -> bool:
    """A finite number (numpy scalars included), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _check_last(c: _Checks, where: str, env) -> bool:
    ok, out = c.call(f"last() {where}", env.last)
    if not ok:
        return False
    if not c.expect(isinstance(out, tuple) and len(out) == 5, f"last() {where} returned {_name(out)}, "
                    "expected a 5-tuple (obs, reward, terminated, truncated, info)"):
        return False
    obs, reward, term, trunc, info = out
    c.expect(isinstance(obs, str), f"last() {where}: observation is {_name(obs)}, expected str")
    c.expect(_is_real(reward), f"last() {where}: reward is {reward!r}, expected a finite float")
    c.expect(isinstance(term, bool), f"last() {where}: terminated is {_name(term)}, expected bool")
    c.expect(isinstance(trunc, bool), f"last() {where}: truncated is {_name(trunc)}, expected bool")
    c.expect(isinstance(info, dict), f"last() {where}: info is {_name(info)}, expected dict")
    return True


def _play(c: _Checks, env, options: dict | None) -> bool:
    """One episode of wrong replies after ``reset(seed=0, options)``; True if it ended in time."""
    label = f"reset(seed=0, options={options})" if options else "reset(seed=0)"
    if not c.call(label, env.reset, seed=0, options=options)[0]:
        return False
    order = list(getattr(env, "possible_agents", []))
    c.expect(order == AGENTS, f"possible_agents is {order!r} after {label}, expected {AGENTS!r}")
    agents = getattr(env, "agents", None)
    c.expect(agents == AGENTS, f"agents is {agents!r} after {label}, expected {AGENTS!r}")
    for t in range(HORIZON):
        for i, expected in enumerate(AGENTS):
            agent = getattr(env, "agent_selection", None)
            if not c.expect(agent == expected, f"agent_selection is {agent!r} at step {t}, turn {i}, "
                                               f"expected {expected!r} (the order of possible_agents)"):
                return False
            ok, obs = c.call(f"observe({agent!r})", env.observe, agent)
            if not ok:
                return False
            got = _name(obs) if not isinstance(obs, str) else "an empty str"
            c.expect(isinstance(obs, str) and obs.strip() != "",
                     f"observe({agent!r}) returned {got}, expected a non-empty str")
            if not c.call(f"step() at step {t} by {agent!r}", env.step, _wrong_reply(agent, t))[0]:
                return False
            if not _check_last(c, f"after step {t} by {agent!r}", env):
                return False
        _check_completed_step(c, env, t)
        if not getattr(env, "agents", None):
            return True
    agents = getattr(env, "agents", None)
    return c.expect(not agents, f"agents is {agents!r} after {HORIZON} wrong steps with horizon={HORIZON}; "
                                "the episode must end (agents == [])")


def _check_completed_step(c: _Checks, env, t: int) -> None:
    rewards, infos = getattr(env, "rewards", None), getattr(env, "infos", None)
    if c.expect(isinstance(rewards, dict), f"rewards is {_name(rewards)} after step {t}, expected dict"):
        missing = [a for a in AGENTS if a not in rewards]
        c.expect(not missing, f"rewards after step {t} has no entry for {missing}")
        bad = {a: r for a, r in rewards.items() if not _is_real(r)}
        c.expect(not bad, f"rewards after step {t} are not finite floats: {bad}")
    if c.expect(isinstance(infos, dict), f"infos is {_name(infos)} after step {t}, expected dict"):
        for a in AGENTS:
            info = infos.get(a)
            if not c.expect(isinstance(info, dict), f"infos[{a!r}] after step {t} is {_name(info)}, expected dict"):
                continue
            for key in ("success", "extracted"):
                c.expect(isinstance(info.get(key), bool),
                         f"infos[{a!r}][{key!r}] after step {t} is {info.get(key)!r}, expected bool")


def _first_obs(c: _Checks, env, options: dict | None) -> str | None:
    label = f"reset(seed=0, options={options})" if options else "reset(seed=0)"
    if c.call(label, env.reset, seed=0, options=options)[0]:
        return c.call(f"observe({AGENTS[0]!r})", env.observe, AGENTS[0])[1]
    return None


def _run(factory: Callable) -> tuple[list[str], int]:
    c = _Checks()
    make = f"construction with agents={AGENTS}, answering={ANSWERING}, horizon={HORIZON}"
    ok, env = c.call(make, factory, agents=list(AGENTS), answering=list(ANSWERING), horizon=HORIZON)
    if not ok:
        return c.problems, c.count
    if _play(c, env, None):
        try:
            env.step("one step too many")
            c.expect(False, "step() on a finished episode did not raise; it must (the caller should reset())")
        except Exception:  # noqa: BLE001 - raising is what we want
            c.expect(True, "")
        ok, state = c.call("state()", env.state)
        if ok and c.expect(isinstance(state, str), f"state() returned {_name(state)}, expected str"):
            missing = [r for r in (_wrong_reply(a, 0) for a in AGENTS) if r not in state]
            c.expect(not missing, f"state() does not contain the actions taken, e.g. {missing[:1]}")
    _play(c, env, {"split": "test", "index": 0})
    # determinism: a second instance, reset with the same seed or test index, shows the same problem
    ok, other = c.call(make, factory, agents=list(AGENTS), answering=list(ANSWERING), horizon=HORIZON)
    if ok:
        for options in (None, {"split": "test", "index": 0}):
            a, b = _first_obs(c, env, options), _first_obs(c, other, options)
            c.expect(a == b, f"two environments reset with seed=0, options={options} show different first "
                             "observations; the same seed must give the same problem")
    return list(dict.fromkeys(c.problems)), c.count


def check_env(factory: Callable) -> list[str]:
    """Problems found with ``factory(agents=..., answering=..., horizon=...)``'s environments; [] if none.

    Each problem is one line naming the method and what was wrong; repeats are listed once.
    """
    return _run(factory)[0]


SHIPPED = {"reasoning_gym": "marft.envs.gym:ReasoningGymEnv", "math": "marft.envs.math:MathEnv",
           "code": "marft.envs.code:CodeEnv", "dataset": "marft.envs.dataset:DatasetEnv",
           "coop": "marft.envs.coop:CoopEnv"}
"""Task kinds ``marft env-check`` also accepts by name: ``marft env-check dataset dataset=... reward=...``."""


def load_env_class(spec: str) -> Callable:
    """The class named by ``"package.module:Class"`` or ``"path/to/file.py:Class"``, or by a shipped
    task kind (:data:`SHIPPED`: ``math``, ``dataset``, ...).

    Raises :class:`UserError` when the spec is malformed, the module cannot be imported, it has no
    such attribute, or the attribute is not callable.
    """
    module_name, _, attr = SHIPPED.get(spec, spec).rpartition(":")
    if not module_name or not attr:
        raise UserError(f"environment {spec!r} must look like 'package.module:Class' or 'path/to/file.py:Class'")
    module = import_user_module(module_name, "marft_user_env_")
    if not hasattr(module, attr):
        raise UserError(f"module {module_name!r} has no attribute {attr!r}; check the name after ':'")
    cls = getattr(module, attr)
    if not callable(cls):
        raise UserError(f"{spec!r} is a {_name(cls)}, not a class or function that builds an environment")
    return cls


def import_user_module(module_name: str, prefix: str):
    """Import ``package.module`` or the file ``path/to/file.py`` (as ``<prefix><file name>``).

    A module name resolves from the working directory too, as ``uvicorn main:app`` and pytest do:
    ``marft env-check my_envs:MyEnv`` run in the folder that holds ``my_envs.py`` finds it. A file's
    own folder is importable from it (``from helpers import ...`` beside ``my_team.py``), as when the
    file is run as a script.

    Raises :class:`UserError` ``cannot import module ...`` when there is no such module or file or
    importing it fails (the exception's type and message are in the line).
    """
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        if not os.path.isfile(module_name):
            raise UserError(f"cannot import module {module_name!r}: no such file")
        name = prefix + os.path.splitext(os.path.basename(module_name))[0]
        folder = os.path.dirname(os.path.abspath(module_name))
        if folder not in sys.path:  # its neighbours import as they do when the file is run as a script
            sys.path.append(folder)  # after the installed packages: a local file never shadows one
        try:
            loader = importlib.util.spec_from_file_location(name, module_name)
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module  # dataclasses and pickling look the module up here
            loader.loader.exec_module(module)
        except KeyboardInterrupt:
            sys.modules.pop(name, None)
            raise
        except BaseException as e:  # noqa: BLE001 - any failure in the user's module, sys.exit() too
            sys.modules.pop(name, None)
            raise UserError(_import_failed(module_name, e)) from e
        return module
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # the console script's path lacks the working directory
        sys.path.append(cwd)  # after the installed packages: a local file never shadows one
    try:
        return importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - sys.exit() in the module too
        raise UserError(_import_failed(module_name, e)) from e


def _import_failed(module_name: str, e: BaseException) -> str:
    """The line for a user's module whose import raised ``e`` (a ``SystemExit`` says so: a script
    that exits when imported)."""
    if isinstance(e, SystemExit):
        code = "" if e.code is None else repr(e.code)
        return (f"cannot import module {module_name!r}: it called sys.exit({code}) while being imported; "
                "put the code that runs it as a script under if __name__ == '__main__':")
    return f"cannot import module {module_name!r}: {_name(e)}: {' '.join(str(e).split())}"


def main_check(spec: str, options: dict) -> int:
    """Check the environment ``spec`` built with ``options``; print the verdict; 0 if it conforms,
    1 (with one ``marft: error:`` line on stderr) if it does not.

    Raises :class:`UserError` when ``spec`` cannot be loaded (see :func:`load_env_class`) or
    building the environment raises one (a missing data file, a bad option: the user's input, not
    the environment, is wrong); any other exception from the constructor is a problem listed.
    """
    factory = partial(load_env_class(spec), **options)
    try:
        factory(agents=list(AGENTS), answering=list(ANSWERING), horizon=HORIZON)
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - reported by the checks, as a problem of the environment
        pass
    problems, count = _run(factory)
    if not problems:
        print(f"env-check: {spec} conforms ({count} checks)")
        return 0
    print(f"env-check: {spec} has {len(problems)} problem(s) ({count} checks):")
    for p in problems:
        print(f"  - {p}")
    print(f"marft: error: environment {spec} does not conform ({len(problems)} problem(s) listed above); "
          "fix them and run marft env-check again", file=sys.stderr)
    return 1
