"""The default duo with a slow tool between its two agents, for the asynchronous-training benchmark
(configs/async_tools.yaml, BENCHMARKS.md): after the planner's call the program looks something up
before asking the solver, and the lookup takes a long-tailed time, as a search engine, a code runner
or another service does: log-normal with a median of 1 s (sigma 0.5), and 1 call in 20 takes 10 s
more. The lookup returns nothing the solver needs; only its time matters.

    .venv/bin/marft train configs/async_tools.yaml                          # synchronous
    .venv/bin/marft train configs/async_tools.yaml train.max_staleness=1 train.async_mode=streaming
"""
import os
import random
import threading
import time

from duo_workflow import PLANNER, SOLVER, exact  # noqa: F401 (exact: the config's reward)

MEDIAN_S = float(os.environ.get("MARFT_TOOL_MEDIAN_S", "1.0"))
_rng, _lock = random.Random(), threading.Lock()  # a fresh draw per call; the same law for every run


def tool_seconds() -> float:
    """One lookup's time: log-normal (median MEDIAN_S, sigma 0.5), plus 10 s one time in 20."""
    with _lock:
        base = _rng.lognormvariate(0.0, 0.5) * MEDIAN_S
        tail = 10.0 * MEDIAN_S if _rng.random() < 0.05 else 0.0
    return base + tail


def duo(problem, client):
    plan = client.chat.completions.create(model="planner", messages=[
        {"role": "system", "content": PLANNER}, {"role": "user", "content": problem["prompt"]}])
    time.sleep(tool_seconds())  # the slow tool
    reply = client.chat.completions.create(model="solver", messages=[
        {"role": "system", "content": SOLVER},
        {"role": "user", "content": problem["prompt"] + "\n\nGive the final answer in \\boxed{}."
         + "\n\nMessages from your teammates:\n[planner]\n" + plan.choices[0].message.content.strip()}])
    return reply.choices[0].message.content
