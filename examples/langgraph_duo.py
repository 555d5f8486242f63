"""The default planner -> solver duo as a LangGraph graph, for `task.kind: workflow`
(configs/workflow_langgraph.yaml). The same team as examples/duo_workflow.py, written the way a
LangGraph user writes it: a typed state, one node per agent, edges between them. Each node calls
its agent through the `openai` client marft hands the workflow (each agent is a model named as the
agent on marft's endpoint), so the graph runs unchanged against any OpenAI-compatible server; marft
records the calls and trains one adapter per agent from them.

    pip install "marft[langgraph]"
    .venv/bin/marft train configs/workflow_langgraph.yaml
"""
from __future__ import annotations

from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

PLANNER = ("You are the planner of a team that solves problems together. Read the problem and write a short "
           "plan of the steps that solve it. Do not carry out the plan yourself.")
SOLVER = ("You are the solver of a team that solves problems together. Solve the problem step by step, "
          "following your teammates' plan if there is one.")


class Team(TypedDict):
    client: Any  # the openai client this episode talks through
    problem: str
    plan: str
    answer: str


def planner(state: Team) -> dict:
    reply = state["client"].chat.completions.create(model="planner", messages=[
        {"role": "system", "content": PLANNER}, {"role": "user", "content": state["problem"]}])
    return {"plan": reply.choices[0].message.content}


def solver(state: Team) -> dict:
    reply = state["client"].chat.completions.create(model="solver", messages=[
        {"role": "system", "content": SOLVER},
        {"role": "user", "content": state["problem"] + "\n\nGive the final answer in \\boxed{}."
         + "\n\nMessages from your teammates:\n[planner]\n" + state["plan"].strip()}])
    return {"answer": reply.choices[0].message.content}


graph = StateGraph(Team)
graph.add_node("planner", planner)
graph.add_node("solver", solver)
graph.add_edge(START, "planner")
graph.add_edge("planner", "solver")
graph.add_edge("solver", END)
team = graph.compile()


def duo(problem, client):
    """marft's workflow entry point: one episode of the graph on one problem."""
    return team.invoke({"client": client, "problem": problem["prompt"], "plan": "", "answer": ""})["answer"]
