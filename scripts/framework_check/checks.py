"""The framework checks of scripts/framework_check.sh, run in the frameworks' venv:
python checks.py REAL_URL SCRIPTED_URL API_KEY. REAL_URL is `marft serve` over the tiny random model (its
replies are noise: the checks there assert the shape), SCRIPTED_URL is scripted_serve.py (a tool call of
add(2, 3), then "The answer is 5." once the tool's result is in the chat: the checks there assert the whole
tool loop). One line per check, `ok NAME` or `FAIL NAME: why`; exit status 1 if any failed."""
import asyncio
import logging
import sys
import warnings
from importlib.metadata import version

import openai
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                    set_default_openai_api, set_default_openai_client, set_tracing_disabled)
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

warnings.filterwarnings("ignore", message=".*create_react_agent")  # deprecated in LangGraph 1.x, still checked
from langgraph.prebuilt import create_react_agent  # noqa: E402

REAL, SCRIPTED, KEY = sys.argv[1:4]
FINAL = "The answer is 5."
QUESTION = "What is 2+3? Use the add tool."
failed, passed = [], []
print("versions:", ", ".join(f"{p} {version(p)}" for p in
                             ("langchain-openai", "langchain-core", "langchain", "langgraph", "openai-agents", "openai")))
set_tracing_disabled(True)
logging.getLogger("openai.agents").setLevel(logging.CRITICAL)  # its "Error getting response" before the 404


def check(name):
    """Run the decorated function now: `ok name` if it returns, `FAIL name: why` if it raises."""
    def run(fn):
        try:
            fn()
            passed.append(name)
            print(f"ok {name}", flush=True)
        except Exception as e:  # noqa: BLE001 - any failure is the check's
            failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}".replace("\n", " ")[:400], flush=True)
    return run


def raises(kind, status, fn):
    try:
        fn()
    except kind as e:
        assert e.status_code == status, f"status {e.status_code}, not {status}"
        return
    raise AssertionError(f"no {kind.__name__} ({status})")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def llm(url, **kw):
    return ChatOpenAI(model="solver", base_url=url, api_key=KEY, **kw)


def total(chunks):
    out = None
    for c in chunks:
        out = c if out is None else out + c
    assert out is not None, "no chunks"
    return out


# LangChain's ChatOpenAI
@check("ChatOpenAI invoke")
def _():
    m = llm(REAL).invoke("What is 2+3?")
    assert isinstance(m, AIMessage) and isinstance(m.content, str), m
    assert m.response_metadata["finish_reason"] in ("stop", "length") and m.usage_metadata["total_tokens"] > 0, m


@check("ChatOpenAI stream")
def _():
    chunks = list(llm(REAL, stream_usage=True).stream("What is 2+3?"))
    m = total(chunks)
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and isinstance(m.content, str), chunks
    assert m.usage_metadata and m.usage_metadata["total_tokens"] > 0, m.usage_metadata


@check("ChatOpenAI batch")
def _():
    out = llm(REAL).batch(["1+1?", "2+2?", "3+3?"])
    assert len(out) == 3 and all(isinstance(m.content, str) for m in out), out


def tool_loop(stream):
    model = llm(SCRIPTED).bind_tools([add])
    ask = (lambda msgs: total(model.stream(msgs))) if stream else model.invoke
    msgs = [HumanMessage(QUESTION)]
    ai = ask(msgs)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("add", {"a": 2, "b": 3})], ai
    call = ai.tool_calls[0]
    msgs += [ai, ToolMessage(str(add(**call["args"])), tool_call_id=call["id"])]
    last = ask(msgs)
    assert last.content == FINAL and not last.tool_calls, last


check("ChatOpenAI bind_tools tool loop (invoke)")(lambda: tool_loop(False))
check("ChatOpenAI bind_tools tool loop (stream)")(lambda: tool_loop(True))


@check("ChatOpenAI forced tool_choice ('required', 'add') -> 400")
def _():
    for choice in ("required", "add"):
        raises(openai.BadRequestError, 400, lambda: llm(SCRIPTED).bind_tools([add], tool_choice=choice).invoke("2+3"))


# LangGraph's ReAct agents
q = {"messages": [{"role": "user", "content": QUESTION}]}
for name, build in (("create_react_agent", lambda m: create_react_agent(m, [add])),
                    ("langchain.agents.create_agent", lambda m: create_agent(m, tools=[add]))):
    @check(f"LangGraph {name} invoke tool loop")
    def _(build=build):
        msgs = build(llm(SCRIPTED)).invoke(q)["messages"]
        kinds = [type(m).__name__ for m in msgs]
        assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
        assert msgs[1].tool_calls[0]["args"] == {"a": 2, "b": 3} and msgs[2].content == "5", msgs
        assert msgs[-1].content == FINAL, msgs[-1]

    @check(f"LangGraph {name} stream_mode='messages' tool loop")
    def _(build=build):
        got = list(build(llm(SCRIPTED)).stream(q, stream_mode="messages"))
        chunks = [c for c, _ in got if isinstance(c, AIMessageChunk)]
        tools = [c for c, meta in got if isinstance(c, ToolMessage) and meta.get("langgraph_node") == "tools"]
        assert any(tc["name"] == "add" for c in chunks for tc in c.tool_call_chunks), got
        assert [t.content for t in tools] == ["5"], got
        assert "".join(c.content for c in chunks).endswith(FINAL), chunks


# the OpenAI Agents SDK
@function_tool(name_override="add")
def add_tool(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def sdk_agent(**settings):
    client = openai.AsyncOpenAI(base_url=SCRIPTED, api_key=KEY)
    return Agent(name="solver", instructions="You add numbers with the add tool.", tools=[add_tool],
                 model=OpenAIChatCompletionsModel(model="solver", openai_client=client),
                 model_settings=ModelSettings(**settings))


def assert_loop(result):
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["MessageOutputItem", "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"] or \
        kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    assert [i.output for i in result.new_items if type(i).__name__ == "ToolCallOutputItem"] == [5], result.new_items
    assert result.final_output == FINAL, result.final_output


check("Agents SDK Runner.run_sync tool loop")(lambda: assert_loop(Runner.run_sync(sdk_agent(), "What is 2+3?", max_turns=4)))


@check("Agents SDK Runner.run_streamed tool loop")
def _():
    async def go():
        r = Runner.run_streamed(sdk_agent(), "What is 2+3?", max_turns=4)
        names = {e.name async for e in r.stream_events() if e.type == "run_item_stream_event"}
        assert {"tool_called", "tool_output", "message_output_created"} <= names, names
        return r
    assert_loop(asyncio.run(go()))


@check("Agents SDK tool_choice='required' -> 400")
def _():
    raises(openai.BadRequestError, 400, lambda: Runner.run_sync(sdk_agent(tool_choice="required"), "2+3", max_turns=2))


@check("Agents SDK default model (Responses API) -> 404")
def _():
    set_default_openai_client(openai.AsyncOpenAI(base_url=REAL, api_key=KEY), use_for_tracing=False)
    raises(openai.NotFoundError, 404, lambda: Runner.run_sync(Agent(name="solver", model="solver"), "hi"))


@check("Agents SDK set_default_openai_api('chat_completions') tool loop")
def _():
    set_default_openai_client(openai.AsyncOpenAI(base_url=SCRIPTED, api_key=KEY), use_for_tracing=False)
    set_default_openai_api("chat_completions")
    assert_loop(Runner.run_sync(Agent(name="solver", model="solver", tools=[add_tool]), "What is 2+3?", max_turns=4))


print(f"{len(passed)} ok, {len(failed)} failed")
sys.exit(1 if failed else 0)
