"""Agent programs of your own as marft episodes: run a workflow per episode against the team's
endpoint (:mod:`marft.serving.serve`) and build the rollout the learner trains on from its calls.

A workflow is ``workflow(problem, client) -> answer`` (a plain function or ``async def``):
``problem`` a dict (the problem's record; ``problem["prompt"]`` its text), ``client`` an
``openai.OpenAI`` client (``openai.AsyncOpenAI`` for an ``async def``) whose base URL records the
calls under this episode; each agent is the model named as the agent. The workflow decides who is
called, how often, in which order, with which messages. Its answer is scored by
``reward(answer, problem)``: a number for the team, ``{agent: number}`` per agent, or a
:class:`marft.envs.Grade` (an environment's verdict).

From the recorded calls (:func:`calls_to_rollout`), Flex-MG's micro-steps: calls made before any
of the others' replies came back (parallel calls: ``asyncio.gather``, a thread pool) are one round,
ordered by the team's agent order whatever their arrival order; the rounds in order fill the steps,
and a call to an agent that already acted in the step, or comes earlier in the team's order, starts
the next step (planner, planner, solver: the planner at step 0, then planner and solver at step 1;
drafter_a and drafter_b gathered, then the judge: one step, drafter_a, drafter_b, judge, in the
team's order); the last call must be to the team's last agent (an episode that ends otherwise fails,
saying so), and the answer graded is what the workflow returns (:func:`answer_text`); the
centralised critic's state before a call is the problem and every earlier reply of the episode in
micro-step order (``"Problem: ..."`` then one ``"[step t] agent: reply"`` line each, the shape of
:meth:`marft.envs.base.TurnBasedEnv.state`); the reward comes at the episode's last step; a step's
agents that were not called are no micro-steps (the advantages pass over them:
:func:`marft.maths.advantages.fold_skipped`). An episode whose workflow raises, runs past ``timeout_s`` or
calls no agent is left out of training (``failed``, its calls kept for its transcript) and counted;
the others go on. An episode's calls are those whose replies reached the program before it returned
(a call it gave up on is generated but not kept; one made after it returned is refused: the server's
:meth:`~marft.serving.serve.TeamServer.close_episode`); an abandoned async workflow is cancelled. The
reward is computed one episode at a time, each bounded by the episodes' timeout (a reward that raises
or hangs fails its episode).

Reproducible batches: the endpoint generates a batch when every running episode is blocked on its
calls (:class:`_Episode`): an async workflow's event loop is idle with no work out in a thread
(exact), a threaded workflow's own thread waits for a reply (exact), calls from threads the workflow
starts itself, or an async workflow's work in a thread, have stopped coming for ``SETTLE_S`` (a
window: a thread that takes longer to make its call joins a later batch). Within
a batch calls are ordered by episode, round, agent, messages and the order the program made them
(an async program's order is fixed; threads' is not, which matters only for calls identical in agent
and messages). So the same seed gives the same replies and steps, parallel calls or not. A workflow
that also waits on something else while its calls are out (a tool, a sleep) is batched without
waiting for it: its calls after that wait join whichever batch comes next, which depends on how
long the wait took.

Each episode runs in a thread of its own (an async workflow in an event loop of its own there), and
the module that holds the workflow is imported once per run: module-level state is shared by every
episode of the run (guard it with a lock) and kept across iterations; the record's ``_episode`` key
is the episode's number in the batch.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import selectors
import threading
import time
from typing import Callable

import torch

from ..engines.base import Reply, pack
from ..envs.base import Grade
from ..envs.guard import guarded
from ..envs.workflow import WorkflowEnv, answer_text
from ..errors import UserError, warn_once
from ..turns import Rollout, Turn


def workflow_rollout(team, engine, envs: list[WorkflowEnv], resets: list, sampling, generator, timeout_s: float) -> Rollout:
    """The rollout of a workflow task: each environment reset to its problem, the workflow run on
    every problem against a :class:`marft.serving.serve.TeamServer` on ``engine`` sampling with
    ``generator`` (so a workflow that asks as the built-in team does gets the same replies)."""
    from .serve import serve_team

    problems = []
    for env, (seed, options) in zip(envs, resets):
        env.reset(seed=seed, options=options)
        problems.append({**env.problem.meta["record"], "prompt": env.problem.prompt, "_episode": len(problems)})
    models = getattr(engine, "models", None)
    if models is None:
        raise UserError(f"task.kind workflow needs an engine with the team's models (hf or vllm), not {engine.name}")

    def grade(answer, problem):
        return envs[problem["_episode"]].score_answer(answer_text(answer))

    with serve_team(models, team, engine, sampling, fixed_sampling=True) as server:
        server.generator = generator if generator is not None else server.generator
        out = play_workflows(team, server, envs[0].workflow_fn, problems, grade, timeout_s, envs[0].success_threshold)
        out.gen_seconds, out.gen_flops = server.gen_seconds, server.gen_flops
        return out


SETTLE_S = 0.05  # an episode whose calls come from threads of its own: no new call for this long, it waits


class _Episode:
    """What the runner's client knows of one episode's calls (the server knows the rest): calls made
    and replies received, the latest batch (round) whose reply came back, and whether the program is
    blocked on its calls. The server's batches start when every running episode is
    (:meth:`settled`), which makes them the same from run to run, parallel calls or not."""

    def __init__(self, poke: Callable[[], None]):
        self.lock = threading.Lock()
        self.poke = poke
        self.made = self.received = self.seq = self.round = 0
        self.last = time.monotonic()  # of the latest call made or reply received
        self.loop = None  # an async workflow's event loop: "busy", or waits with "no timer" or "timers" (None: threaded)
        self.thread = None  # a threaded workflow's own thread
        self.inside: set[int] = set()  # threads waiting for a reply
        self.jobs = 0  # an async workflow's work out in threads (run_in_executor: asyncio.to_thread, name lookups)
        self.threads: set[int] = set()  # every thread that made a call
        self.got: set[int] = set()  # the seq of every call whose reply reached the program
        self.kept: set[int] | None = None  # ``got`` when the workflow returned: the calls that are the episode's
        self.task = self.aloop = None  # an async workflow's task and its event loop (to cancel it when abandoned)
        self.done = False

    def made_call(self, request) -> None:
        tid = threading.get_ident()
        with self.lock:
            request.headers["x-marft-round"] = str(self.round)
            request.headers["x-marft-seq"] = str(self.seq)
            self.seq += 1
            self.made += 1
            self.inside.add(tid)
            self.threads.add(tid)
            self.last = time.monotonic()

    def got_reply(self, request, response) -> None:
        with self.lock:
            self.received += 1
            self.inside.discard(threading.get_ident())
            self.last = time.monotonic()
            if response is not None and response.status_code == 200:
                self.got.add(int(request.headers["x-marft-seq"]))
            try:
                self.round = max(self.round, int(response.headers.get("x-marft-round", 0)))
            except (AttributeError, ValueError):  # no response (the call failed), or no such header
                pass

    def job_done(self) -> None:
        with self.lock:
            self.jobs -= 1
            self.last = time.monotonic()

    def waits(self, state: str) -> None:
        """An async workflow's event loop starts waiting (``"no timer"``, ``"timers"``) or stops
        (``"busy"``); when it starts with calls out, the server looks at the episodes again."""
        self.loop = state
        if state != "busy" and self.made > self.received:
            self.poke()

    def settled(self, waiting: int, now: float) -> bool:
        """Every call the program made is waiting at the server (``waiting`` of them) and the program
        waits for them: an async workflow's event loop waits for I/O with no timer set and no work out
        in a thread (with a timer, a sleep or a timeout of the program's own, or work in a thread:
        no call made, reply received or thread's work finished for SETTLE_S), a
        threaded workflow's own thread waits for a reply (a call from another thread of its own: no
        call made or reply received for SETTLE_S). A program that sends calls through clients of its
        own (the server has more than this client made) is settled as soon as one waits: calls made
        one at a time batch exactly."""
        if self.done:
            return True
        with self.lock:
            out = self.made - self.received
            if waiting < 1 or waiting < out:
                return False
            if waiting > out:
                return True
            if self.loop == "busy":
                return False
            if self.loop == "no timer" and not self.jobs:
                return True
            if self.loop is None and self.threads == {self.thread} and self.thread in self.inside:
                return True
            return now - self.last >= SETTLE_S


def _http():
    """The HTTP library the ``openai`` client is built on (httpx, or httpx2 in newer releases)."""
    import importlib

    import openai

    return importlib.import_module(openai.DefaultHttpxClient.__bases__[0].__module__.split(".")[0])


def _transport(episode: _Episode, inner):
    """A transport (of :func:`_http`'s library, sync or async as ``inner``) that tells ``episode`` of
    every call and reply, around ``inner``."""
    httpx = _http()
    if isinstance(inner, httpx.AsyncBaseTransport):
        class CountedAsync(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request):
                episode.made_call(request)
                response = None
                try:
                    response = await inner.handle_async_request(request)
                finally:
                    episode.got_reply(request, response)
                return response

            async def aclose(self):
                await inner.aclose()

        return CountedAsync()

    class Counted(httpx.BaseTransport):
        def handle_request(self, request):
            episode.made_call(request)
            response = None
            try:
                response = inner.handle_request(request)
            finally:
                episode.got_reply(request, response)
            return response

    return Counted()


class _WatchedLoop(asyncio.SelectorEventLoop):
    """An async workflow's event loop: its selector (:class:`_Watched`) says when it waits, and it
    counts the work it hands to threads (``run_in_executor``: ``asyncio.to_thread``, name lookups),
    since a loop that waits for a thread waits for more than its calls (a thread's work joins the
    batch within SETTLE_S, as a timer does: :meth:`_Episode.settled`)."""

    def __init__(self, episode: _Episode):
        super().__init__(_Watched(episode))
        self.episode = episode

    def run_in_executor(self, executor, func, *args):
        with self.episode.lock:
            self.episode.jobs += 1
        future = super().run_in_executor(executor, func, *args)
        future.add_done_callback(lambda _: self.episode.job_done())
        return future


@functools.cache
def _platform():
    """What the ``openai`` client puts in its headers about this machine, looked up once."""
    from openai._base_client import get_platform

    return get_platform()


def _knows_platform(client) -> None:
    """The ``openai`` async client looks the platform up in a thread at its first request, before the
    request is made: a wait that is not for a call. Told here (once per process), the client's calls
    batch exactly; a client without the attribute (another release) is left as it is."""
    if getattr(client, "_platform", False) is None:
        try:
            client._platform = _platform()
        except (ImportError, AttributeError):  # another release of openai: it looks the platform up itself
            pass


class _Watched(selectors.DefaultSelector):
    """The selector of an async workflow's event loop: the loop waits exactly when it selects with a
    timeout that is not 0 (asyncio selects with 0 while callbacks are ready): for I/O alone with no
    timeout, else for a timer too (the runner's clients set none: their episodes' deadline is the
    runner's)."""

    def __init__(self, episode: _Episode):
        super().__init__()
        self.episode = episode

    def select(self, timeout=None):
        if timeout is not None and timeout <= 0:
            return super().select(timeout)
        self.episode.waits("no timer" if timeout is None else "timers")
        try:
            return super().select(timeout)
        finally:
            self.episode.waits("busy")


def play_workflows(team, server, workflow: Callable, problems: list[dict], reward: Callable,
                   timeout_s: float = 300.0, success_threshold: float = 1.0, reward_timeout_s: float | None = None) -> Rollout:
    """Run ``workflow`` once per problem, all at once, against ``server`` (a started
    :class:`marft.serving.serve.TeamServer`); return the rollout of their calls.

    Batches start when every running episode is blocked on its calls (:meth:`_Episode.settled`), so
    the same seed gives the same replies whatever the order in which parallel calls arrive. An
    episode's calls are those whose replies reached the program before it returned; ``reward`` is
    called one episode at a time, each call bounded by ``reward_timeout_s`` (default ``timeout_s``)."""
    reward_timeout_s = timeout_s if reward_timeout_s is None else reward_timeout_s
    import openai

    httpx = _http()
    E = len(problems)
    ids = [f"{e:06d}" for e in range(E)]  # sorted as numbers: the batches keep episode order
    answers: list = [None] * E
    errors: list[str | None] = [None] * E
    episodes = [_Episode(server.poke) for _ in range(E)]

    def ready(waiting: dict[str, int]) -> bool:
        now = time.monotonic()
        if not waiting.keys() <= set(ids):  # a call outside the episodes: as soon as all wait
            return all(ep.done or waiting.get(i, 0) > 0 for i, ep in zip(ids, episodes))
        return all(ep.settled(waiting.get(i, 0), now) for i, ep in zip(ids, episodes))

    server.ready = ready
    server.patience_s = min(server.patience_s, timeout_s / 4)  # an episode busy elsewhere holds the rest back at most this
    is_async = inspect.iscoroutinefunction(workflow)
    runner = getattr(asyncio, "Runner", None)  # Python 3.11: an event loop of our own (_WatchedLoop)

    def finish(e: int) -> None:
        ep = episodes[e]
        with ep.lock:
            if ep.kept is None:  # the calls whose replies the program had when it returned (or was abandoned)
                ep.kept = set(ep.got)
        ep.done = True
        server.close_episode(ids[e])  # a call it makes now is refused: it would not be the episode's
        server.poke()

    def one(e: int) -> None:
        ep = episodes[e]
        try:
            if is_async:
                async def go():
                    http = openai.DefaultAsyncHttpxClient(transport=_transport(ep, httpx.AsyncHTTPTransport()),
                                                          trust_env=False)
                    async with openai.AsyncOpenAI(base_url=server.base_url(ids[e]), api_key=server.api_key,
                                                  max_retries=0, timeout=None, http_client=http) as client:
                        _knows_platform(client)
                        ep.task, ep.aloop = asyncio.current_task(), asyncio.get_running_loop()
                        return await workflow(problems[e], client)
                if runner is None:
                    answers[e] = asyncio.run(go())
                else:
                    with runner(loop_factory=lambda: _WatchedLoop(ep)) as run:
                        answers[e] = run.run(go())
            else:  # one connection pool for every episode (building one takes about 20 ms of CPU)
                ep.thread = threading.get_ident()
                http = openai.DefaultHttpxClient(transport=_transport(ep, shared), trust_env=False)
                client = openai.OpenAI(base_url=server.base_url(ids[e]), api_key=server.api_key, max_retries=0,
                                       timeout=timeout_s, http_client=http)
                answers[e] = workflow(problems[e], client)
        except BaseException as err:  # noqa: BLE001 - the user's program failed (sys.exit() too): this episode only
            if errors[e] is None:  # not after a timeout (an abandoned async workflow is cancelled)
                errors[e] = f"the workflow raised {type(err).__name__}: {err}"
        finally:
            finish(e)

    start = time.perf_counter()
    shared = None if is_async else httpx.HTTPTransport(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
    threads = [threading.Thread(target=one, args=(e,), daemon=True, name=f"marft-workflow-{e}") for e in range(E)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    # the batches are generated here, in the thread that also runs the learner (TeamServer.pump)
    server.pump(lambda: all(ep.done for ep in episodes) or time.monotonic() >= deadline)
    for e, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():  # abandoned: it no longer holds the batches back, and its calls are refused
            errors[e] = f"the workflow ran past {timeout_s:g} s (timeout)"
            finish(e)
            if episodes[e].task is not None:  # an async one is cancelled at its next await
                with contextlib.suppress(RuntimeError):
                    episodes[e].aloop.call_soon_threadsafe(episodes[e].task.cancel)
    seconds = time.perf_counter() - start
    if shared is not None:
        shared.close()  # an abandoned episode's next request fails (it is left out already)
    recorded = [server.calls(i) for i in ids]
    calls = [_kept(r, ep.kept) for r, ep in zip(recorded, episodes)]
    dropped = sum(len(r) - len(c) for r, c in zip(recorded, calls))
    if dropped:
        warn_once(f"warning: {dropped} call(s) whose replies the workflow never received (it returned, or gave up on "
                  "them, before they came) are left out of their episodes; said once per run", key="calls_not_received")
    for i in ids:
        server.forget(i)
    scores = []
    for e in range(E):
        last = _in_steps(team, calls[e])[-1][1] if calls[e] else None
        if errors[e] is None and not calls[e]:
            errors[e] = "the workflow called no agent"
        elif errors[e] is None and last.agent != team.names[-1]:
            errors[e] = (f"the workflow's last call was to {last.agent}, not to {team.names[-1]}: the team's "
                         "last agent must give the answer (list the agents in the order they act, the answering one last)")
        scores.append(None)
    scored = [e for e in range(E) if errors[e] is None]

    def score(e: int) -> None:
        scores[e] = reward(answers[e], problems[e])

    for e, err in zip(scored, guarded([functools.partial(score, e) for e in scored], False, reward_timeout_s)):
        if err is not None:
            errors[e], scores[e] = f"the reward function {'' if err.startswith('timed out') else 'raised '}{err}", None
    out = calls_to_rollout(team, problems, calls, scores, errors, success_threshold, answers)
    out.seconds = seconds
    return out


def _kept(calls: list, kept: set[int] | None) -> list:
    """An episode's recorded calls without those whose replies its program never received (it had
    returned, or given up on them: a timeout of its own); calls its client did not stamp (a client of
    the program's own) are all kept."""
    return [c for c in calls if not getattr(c, "stamped", False) or kept is None or c.seq in kept]


def _in_steps(team, calls: list) -> list[tuple[int, object]]:
    """An episode's calls as Flex-MG micro-steps, ``[(step, call), ...]`` in execution order. Calls
    of one round (made before any of the others' replies came back: :class:`marft.serving.serve.Call`) are
    ordered by the team's agent order, then by what they ask, then as the program made them; the
    steps are filled in that order: a call to an agent that already acted in the step, or comes
    earlier in the team's order, starts the next step. So parallel calls (``asyncio.gather``, a
    thread pool) are one step whatever their arrival order (two calls to one agent: two steps), and
    a sequential chain of the team's agents is one step, as the team loop plays it."""
    from .serve import messages_key

    order = {a: i for i, a in enumerate(team.names)}
    ranked = sorted(calls, key=lambda c: (c.round, order[c.agent], messages_key(c.messages), c.seq, c.index))
    out, t, prev = [], 0, -1
    for c in ranked:
        i = order[c.agent]
        if i <= prev:
            t += 1
        prev = i
        out.append((t, c))
    return out


def calls_to_rollout(team, problems: list[dict], calls: list[list], scores: list, errors: list[str | None],
                     success_threshold: float = 1.0, answers: list | None = None) -> Rollout:
    """The rollout of recorded calls (:class:`marft.serving.serve.Call`, one list per episode): one
    :class:`Turn` per (step, agent) with that micro-step's episodes in episode order, the steps as
    :func:`_in_steps` makes them; ``scores[e]`` the episode's reward (a number, or ``{agent: number}``),
    given at its last step. A failed episode keeps the calls it made (its transcript shows them);
    :meth:`Rollout.select` leaves it out of training."""
    names = team.names
    E, N = len(problems), len(names)
    failed = torch.tensor([err is not None for err in errors], dtype=torch.bool)
    rows: dict[tuple[int, str], list[tuple[int, Reply, str, list[dict], int | None]]] = {}
    steps = torch.zeros(E, dtype=torch.long)
    order = {a: i for i, a in enumerate(names)}
    for e in range(E):
        t = 0
        state = f"Problem: {problems[e].get('prompt', '')}"
        for t, c in _in_steps(team, calls[e]):
            rows.setdefault((t, c.agent), []).append(
                (e, Reply(c.prompt_ids, c.response_ids, c.logprobs, c.truncated, c.text), state, c.messages,
                 getattr(c, "version", None)))
            state += f"\n[step {t}] {c.agent}: {c.text}"
        steps[e] = t + 1
    H = max(int(steps.max()) if E else 1, 1)
    rewards, agent_rewards = torch.zeros(E, H), torch.zeros(E, H, N)
    dones = torch.zeros(E, H, dtype=torch.bool)
    success, extracted = torch.zeros(E, dtype=torch.bool), torch.zeros(E, dtype=torch.bool)
    infos: list[dict] = []
    for e in range(E):
        last = int(steps[e]) - 1
        dones[e, last] = True
        if failed[e]:
            infos.append({"success": False, "extracted": False, "error": errors[e]})
            continue
        s = scores[e]
        if isinstance(s, Grade):  # an environment's verdict: its score, success and extraction
            value = float(s.correct) if s.score is None else float(s.score)
            per = [value] * N
        else:
            per = [float(s.get(a, 0.0)) for a in names] if isinstance(s, dict) else [float(s)] * N
        agent_rewards[e, last] = torch.tensor(per)
        rewards[e, last] = sum(per) / N
        success[e] = s.correct if isinstance(s, Grade) else rewards[e, last] >= success_threshold
        extracted[e] = s.extracted if isinstance(s, Grade) else answers is None or answers[e] is not None
        infos.append({"success": bool(success[e]), "extracted": bool(extracted[e]),
                      "answer": None if answers is None else answers[e]})
    turns = []
    for (t, agent) in sorted(rows, key=lambda k: (k[0], order[k[1]])):
        got = sorted(rows[(t, agent)], key=lambda x: x[0])
        out = pack([r for _, r, _, _, _ in got], 0)
        versions = [v for *_, v in got]  # each call's own version (asynchronous training), else None
        turns.append(Turn(t, agent, torch.tensor([e for e, *_ in got], dtype=torch.long), out.prompt_ids,
                          out.prompt_mask, out.response_ids, out.response_mask, out.logprobs, out.truncated,
                          out.texts, [s for _, _, s, _, _ in got], [m for _, _, _, m, _ in got],
                          None if all(v is None for v in versions) else torch.tensor([-1 if v is None else v for v in versions])))
    return Rollout(turns, rewards, agent_rewards, dones, steps, success, extracted, infos=infos, failed=failed)
