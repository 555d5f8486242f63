"""The default planner -> solver duo written as a plain `openai`-client program, for
`task.kind: workflow` (configs/workflow_duo.yaml). marft serves each agent as a model named as the
agent, records every call, and trains the adapters from them; the program decides who is called,
in which order and with which messages.

    .venv/bin/marft train configs/workflow_duo.yaml
"""
import re

PLANNER = ("You are the planner of a team that solves problems together. Read the problem and write a short "
           "plan of the steps that solve it. Do not carry out the plan yourself.")
SOLVER = ("You are the solver of a team that solves problems together. Solve the problem step by step, "
          "following your teammates' plan if there is one.")


def duo(problem, client):
    """problem: the data set's record ("prompt": its question); client: an openai.OpenAI client."""
    plan = client.chat.completions.create(model="planner", messages=[
        {"role": "system", "content": PLANNER}, {"role": "user", "content": problem["prompt"]}])
    text = plan.choices[0].message.content
    reply = client.chat.completions.create(model="solver", messages=[
        {"role": "system", "content": SOLVER},
        {"role": "user", "content": problem["prompt"] + "\n\nGive the final answer in \\boxed{}."
         + "\n\nMessages from your teammates:\n[planner]\n" + text.strip()}])
    return reply.choices[0].message.content


def exact(answer, record):
    """The reward: 1 when the last \\boxed{} (or else the last number) of the answer is the sum."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", answer or "")
    numbers = re.findall(r"-?\d+", boxed[-1] if boxed else answer or "")
    return 1.0 if numbers and numbers[-1] == record["answer"] else 0.0
