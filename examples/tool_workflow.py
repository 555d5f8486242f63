"""A team program whose solver calls a tool, for `task.kind: workflow` (configs/workflow_tools.yaml):
the planner writes a plan, the solver is offered a calculator (`add`) through the OpenAI `tools`
field; when it calls it, the program runs the tool and sends the result back (`role: "tool"`), and
asks the solver again, at most three times, for its final answer.

marft shows the tool to the model (its chat template's tool format, or Hermes/Qwen2.5 `<tool_call>`
text for a template without one), hands the reply's `<tool_call>` blocks back as `tool_calls`, and
trains on the replies as the model wrote them: each solver call is a micro-step (planner, solver,
[solver, ...]), the reward of the final answer comes at the last step.

    .venv/bin/marft train configs/workflow_tools.yaml
"""
import json

from duo_workflow import PLANNER, SOLVER, exact  # noqa: F401 (exact: the config's reward)

ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def add(arguments: str) -> str:
    """The tool, run by this program (never by marft): the sum, or what was wrong with the call."""
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as err:
        return f"error: {err!r}; call add with two integers a and b"


def solve(problem, client):
    plan = client.chat.completions.create(model="planner", messages=[
        {"role": "system", "content": PLANNER}, {"role": "user", "content": problem["prompt"]}])
    messages = [{"role": "system", "content": SOLVER},
                {"role": "user", "content": problem["prompt"] + "\n\nGive the final answer in \\boxed{}."
                 + "\n\nMessages from your teammates:\n[planner]\n" + plan.choices[0].message.content.strip()}]
    for _ in range(3):  # the solver, with the tool's results, until it answers without calling it
        reply = client.chat.completions.create(model="solver", messages=messages, tools=[ADD]).choices[0].message
        if not reply.tool_calls:
            return reply.content
        messages.append({"role": "assistant", "content": reply.content,
                         "tool_calls": [c.model_dump() for c in reply.tool_calls]})
        messages += [{"role": "tool", "tool_call_id": c.id,
                      "content": add(c.function.arguments) if c.function.name == "add" else "error: no such tool"}
                     for c in reply.tool_calls]
    return reply.content or ""  # still calling the tool after three tries: no answer
