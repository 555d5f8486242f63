"""A team program the config format cannot express, for `task.kind: workflow`
(configs/workflow_loop.yaml): the planner is asked for two plans at once (two calls in parallel),
then the solver answers from both, and is asked again, with its previous answer and a reminder,
until its answer holds a \\boxed{} answer or it has tried three times.

marft turns the calls into Flex-MG micro-steps in call order (planner, planner, solver, [solver,
...]): the second planner call starts a new step, and so does each retry of the solver; the reward
of the final answer comes at the last step.

    .venv/bin/marft train configs/workflow_loop.yaml
"""
import re
from concurrent.futures import ThreadPoolExecutor

from duo_workflow import PLANNER, SOLVER, exact  # noqa: F401 (exact: the config's reward)

ANGLES = ("Plan it as briefly as you can.", "Plan it step by step.")


def loop(problem, client):
    def ask(agent, system, text):
        reply = client.chat.completions.create(model=agent, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": text}])
        return reply.choices[0].message.content

    with ThreadPoolExecutor(2) as pool:  # the planner twice, at once
        plans = list(pool.map(lambda angle: ask("planner", PLANNER, problem["prompt"] + "\n\n" + angle), ANGLES))
    notes = "\n".join(f"[planner, plan {k + 1}]\n{p.strip()}" for k, p in enumerate(plans))
    answer, question = "", problem["prompt"] + "\n\nGive the final answer in \\boxed{}.\n\nMessages from your teammates:\n" + notes
    for _ in range(3):  # the solver until its answer is boxed, at most three tries
        answer = ask("solver", SOLVER, question)
        if re.search(r"\\boxed\{[^{}]*\}", answer):
            break
        question += f"\n\nYour last answer was:\n{answer.strip()}\nIt has no \\boxed{{}} answer. Give one."
    return answer
