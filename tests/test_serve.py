"""The team behind an OpenAI-compatible endpoint (marft/serving/serve.py), through the real `openai`
client and plain HTTP: agents as models, every call recorded as the learner needs it, replies
equal to the engine's own for the same chats and seed, batching, and OpenAI-style 4xx errors that
leave the endpoint serving."""
from __future__ import annotations

import json
import threading
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.engines import make_engine  # noqa: E402
from marft.engines.generation import Sampling  # noqa: E402
from marft.serving.serve import serve_team  # noqa: E402

SAMPLING = Sampling(temperature=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def team_parts(tiny_model_dir, tmp_path_factory):
    cfg = load_config("configs/duo_arithmetic.yaml", [f"model.name={tiny_model_dir}", "model.dtype=float32",
                                                      "model.device=cpu", f"output_dir={tmp_path_factory.mktemp('r')}",
                                                      "team.max_new_tokens={planner: 4}"])
    team, models, _ = prepare(cfg)
    return team, models, make_engine(cfg, models)


@pytest.fixture
def server(team_parts):
    team, models, engine = team_parts
    with serve_team(models, team, engine, SAMPLING, seed=7) as s:
        yield s


def chat(text: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


def test_agents_are_models_and_calls_are_recorded_as_the_engine_replies(server, team_parts):
    team, models, engine = team_parts
    client = openai.OpenAI(base_url=server.base_url("ep0"), api_key=server.api_key)
    assert [m.id for m in client.models.list().data] == ["planner", "solver"]
    r = client.chat.completions.create(model="solver", messages=chat("Calculate 1 + 2."))
    (call,) = server.calls("ep0")
    assert r.choices[0].message.content == call.text and r.model == "solver"
    assert r.usage.prompt_tokens == len(call.prompt_ids) and r.usage.completion_tokens == len(call.response_ids)
    assert r.choices[0].finish_reason == ("length" if call.truncated else "stop")
    assert len(call.logprobs) == len(call.response_ids) > 0 and all(lp <= 0 for lp in call.logprobs)
    # the same chat through the engine with the same seed: the same tokens and log-probabilities
    out = engine.generate("solver", [chat("Calculate 1 + 2.")], SAMPLING, torch.Generator().manual_seed(7))
    assert call.prompt_ids == out.prompt_ids[0][out.prompt_mask[0]].tolist()
    assert call.response_ids == out.response_ids[0][out.response_mask[0]].tolist()
    assert call.logprobs == pytest.approx(out.logprobs[0][out.response_mask[0]].tolist())
    # the planner's own reply limit (4) caps a larger max_tokens; the call order is kept per episode
    client.chat.completions.create(model="planner", messages=chat("Plan."), max_tokens=50, temperature=0.5)
    first, second = server.calls("ep0")
    assert (first.index, second.index, second.agent) == (0, 1, "planner")
    assert second.sampling.max_new_tokens == 4 and second.sampling.temperature == 0.5
    assert len(second.response_ids) <= 4
    assert server.calls("other") == []


def test_concurrent_requests_are_generated_as_one_batch_per_agent(team_parts):
    team, models, engine = team_parts
    with serve_team(models, team, engine, SAMPLING, ready=lambda waiting: sum(waiting.values()) == 4) as server:
        def ask(i):
            c = openai.OpenAI(base_url=server.base_url(f"e{i}"), api_key=server.api_key)
            c.chat.completions.create(model="solver" if i % 2 else "planner", messages=chat(f"Calculate {i} + 1."))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(server.batches) == [("planner", 2), ("solver", 2)]
        assert all(len(server.calls(f"e{i}")) == 1 for i in range(4))


def _post(server, body, key=None, path="/v1/chat/completions"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.host}:{server.port}{path}", data=data, method="POST",
                                 headers={"Authorization": f"Bearer {key or server.api_key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body,key,status,code_or_param", [
    ({"model": "solver", "messages": chat("x")}, "sk-wrong", 401, "invalid_api_key"),
    ({"model": "nobody", "messages": chat("x")}, None, 404, "model_not_found"),
    (b"{not json", None, 400, None),
    ([1, 2], None, 400, None),
    ({"model": "solver"}, None, 400, "messages"),
    ({"model": "solver", "messages": [{"role": "robot", "content": "x"}]}, None, 400, "messages[0].role"),
    ({"model": "solver", "messages": [{"role": "user", "content": 3}]}, None, 400, "messages[0].content"),
    # streaming: a refused request is a JSON error before any stream starts, as OpenAI's
    ({"model": "solver", "messages": chat("x"), "stream": True}, "sk-wrong", 401, "invalid_api_key"),
    ({"model": "nobody", "messages": chat("x"), "stream": True}, None, 404, "model_not_found"),
    ({"model": "solver", "stream": True}, None, 400, "messages"),
    ({"model": "solver", "messages": chat("x"), "stream": True, "n": 2}, None, 400, "n"),
    ({"model": "solver", "messages": chat("x"), "stream": "yes"}, None, 400, "stream"),
    ({"model": "solver", "messages": chat("x"), "stream": True, "stream_options": 3}, None, 400, "stream_options"),
    ({"model": "solver", "messages": chat("x"), "stream": True, "stream_options": {"include_usage": "yes"}}, None, 400,
     "stream_options"),
    ({"model": "solver", "messages": chat("x"), "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),  # only with stream: true
    ({"model": "solver", "messages": chat("x"), "stream": False, "stream_options": {}}, None, 400, "stream_options"),
    ({"model": "solver", "messages": chat("x"), "n": 2}, None, 400, "n"),
    ({"model": "solver", "messages": chat("x"), "temperature": 9}, None, 400, "temperature"),
    ({"model": "solver", "messages": chat("x"), "max_tokens": 0}, None, 400, "max_tokens"),
    ({"model": "solver", "messages": chat("x"), "stop": ["a", "b", "c", "d", "e"]}, None, 400, "stop"),
    ({"model": "solver", "messages": chat("x"), "stop": ""}, None, 400, "stop"),
    ({"model": "solver", "messages": chat("x"), "stop": ["a", ""]}, None, 400, "stop"),
    ({"model": "solver", "messages": chat("x"), "stop": 3}, None, 400, "stop"),
    ({"model": "solver", "messages": chat("word " * 3000)}, None, 400, "context_length_exceeded"),
    (b"[" * 100000 + b"]" * 100000, None, 400, None),  # was a 500: json's RecursionError is no ValueError
    ({"messages": chat("x")}, None, 400, "missing_required_parameter"),  # no model: was a 404 for the model None
    ({"model": "solver", "messages": chat("x"), "logprobs": "yes"}, None, 400, "logprobs"),
    ({"model": "solver", "messages": chat("x"), "logprobs": True, "top_logprobs": 3}, None, 400, "top_logprobs"),
    ({"model": "solver", "messages": chat("x"), "top_logprobs": 0}, None, 400, "top_logprobs"),  # needs logprobs: true
])
def test_bad_requests_get_openai_errors_and_the_endpoint_goes_on(server, body, key, status, code_or_param):
    got, reply = _post(server, body, key)
    assert got == status, reply
    err = reply["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if code_or_param:
        assert code_or_param in (err["code"], err["param"])
    ok, reply = _post(server, {"model": "solver", "messages": chat("Calculate 2 + 2.")})
    assert ok == 200 and reply["choices"][0]["message"]["role"] == "assistant"


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force(server):
    # null is "not given" (it used to hide max_tokens: the reply ran to the limit, 6)
    ok, reply = _post(server, {"model": "solver", "messages": chat("Count to ten."), "max_completion_tokens": None,
                               "max_tokens": 3})
    assert ok == 200 and reply["usage"]["completion_tokens"] <= 3, reply
    assert server.calls()[-1].sampling.max_new_tokens == 3
    ok, reply = _post(server, {"model": "solver", "messages": chat("Count."), "max_completion_tokens": 2, "max_tokens": 5})
    assert ok == 200 and server.calls()[-1].sampling.max_new_tokens == 2  # the newer name wins
    got, reply = _post(server, {"model": "solver", "messages": chat("x"), "max_completion_tokens": -1, "max_tokens": 3})
    assert got == 400 and reply["error"]["param"] == "max_completion_tokens", reply


def test_logprobs_are_the_recorded_behaviour_log_probabilities(server, capsys, monkeypatch):
    """logprobs: true returns each sampled token with the log-probability the call records (the one
    the learner's ratio starts from), streamed too; fields the endpoint does not apply are one warning."""
    import marft.errors

    monkeypatch.setattr(marft.errors, "WARNED", set())
    client = openai.OpenAI(base_url=server.base_url("lp"), api_key=server.api_key)
    r = client.chat.completions.create(model="solver", messages=chat("Calculate 1 + 2."), logprobs=True, top_logprobs=0,
                                       seed=5, frequency_penalty=0.5)
    (call,) = server.calls("lp")
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == call.logprobs and len(content) == len(call.response_ids)
    assert "".join(c.token for c in content).startswith(call.text) and all(c.top_logprobs == [] for c in content)
    assert client.chat.completions.create(model="solver", messages=chat("x")).choices[0].logprobs is None  # not asked
    chunks = list(client.chat.completions.create(model="solver", messages=chat("Calculate 1 + 2."), logprobs=True,
                                                 stream=True))
    streamed = [c.logprob for k in chunks for ch in k.choices if ch.logprobs for c in ch.logprobs.content]
    assert streamed == server.calls("lp")[-1].logprobs
    assert capsys.readouterr().err.count("warning: the endpoint ignores frequency_penalty, seed") == 1


def test_a_null_n_is_one_reply(server):
    ok, reply = _post(server, {"model": "solver", "messages": chat("Calculate 1 + 1."), "n": None})
    assert ok == 200 and len(reply["choices"]) == 1, reply  # was a 400: "n must be 1, got None"
    for n in (True, 0, "1"):
        got, reply = _post(server, {"model": "solver", "messages": chat("x"), "n": n})
        assert got == 400 and reply["error"]["param"] == "n", (n, reply)


def _greedy(server, episode, **fields):
    """The solver's greedy reply to one chat (the same whatever the seed) and the call recorded for it."""
    body = {"model": "solver", "messages": chat("Calculate 1 + 2."), "temperature": 0, **fields}
    ok, reply = _post(server, body, path=f"/episodes/{episode}/v1/chat/completions")
    assert ok == 200, reply
    (call,) = server.calls(episode)
    return reply["choices"][0], call


def test_a_stop_string_cuts_the_reply_before_it_and_the_recorded_call_after_the_token_completing_it(server,
                                                                                                     team_parts):
    # a ReAct program sends stop=["\nObservation:"]: the stop string used to be ignored, the reply ran past it
    tok = team_parts[1].for_agent("solver")[1]
    whole, full = _greedy(server, "whole")
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # somewhere inside the reply
    assert stop and "\ufffd" not in stop, text
    client = openai.OpenAI(base_url=server.base_url("cut"), api_key=server.api_key)
    r = client.chat.completions.create(model="solver", messages=chat("Calculate 1 + 2."), temperature=0, stop=stop)
    (call,) = server.calls("cut")
    assert r.choices[0].message.content == call.text == text[:text.index(stop)] != text
    assert r.choices[0].finish_reason == "stop" and not call.truncated and whole["finish_reason"] == "length"
    # the sampled tokens up to the one that completed the stop string, with their log-probabilities
    k = len(call.response_ids)
    assert 0 < k < len(full.response_ids) and call.response_ids == full.response_ids[:k]
    assert call.logprobs == pytest.approx(full.logprobs[:k]) and r.usage.completion_tokens == k
    assert stop in tok.decode(call.response_ids, skip_special_tokens=True)
    assert stop not in tok.decode(call.response_ids[:-1], skip_special_tokens=True)
    # the list form: the first stop string to occur; one that never occurs changes nothing
    listed, call2 = _greedy(server, "listed", stop=["never in this reply", stop])
    assert listed["message"]["content"] == call.text and call2.response_ids == call.response_ids
    for i, never in enumerate(("never in this reply", ["never", "in this reply"], None)):
        same, call3 = _greedy(server, f"never{i}", stop=never)
        assert same == whole and (call3.response_ids, call3.logprobs, call3.truncated, call3.text) == \
            (full.response_ids, full.logprobs, full.truncated, full.text)


def test_a_stop_string_split_across_byte_tokens_ends_the_reply_at_the_token_completing_it(team_parts):
    # "é" is two byte-level tokens, neither of which decodes to it alone (the check decoded each token
    # on its own, and missed it)
    from marft.engines.generation import _stop_string_hit

    tok = team_parts[1].for_agent("solver")[1]
    ids = tok.encode("The answer é is 19.", add_special_tokens=False)
    assert len(tok.encode("é", add_special_tokens=False)) == 2
    replies, done, ends = [[]], torch.zeros(1, dtype=torch.bool), []
    for k, t in enumerate(ids):
        if _stop_string_hit(tok, torch.tensor([t]), done, replies, ("é", "nowhere"))[0]:
            ends.append(k)
    first = ends[0]
    assert "é" in tok.decode(ids[:first + 1]) and "é" not in tok.decode(ids[:first])
    from marft.serving.serve import _before_stop
    assert _before_stop("The answer é is 19.", ("is", "é")) == "The answer " and _before_stop("ab", ("c",)) == "ab"


@pytest.mark.parametrize("method,path,status,allow", [
    ("GET", "/v1/chat/completions", 405, "POST"),
    ("POST", "/v1/models", 405, "GET"),
    ("POST", "/v1/nothing", 404, None),
    ("GET", "/", 404, None),
    ("POST", "/episodes/e1/v1/completions", 404, None),
])
def test_a_wrong_path_or_method_gets_an_openai_error(server, method, path, status, allow):
    req = urllib.request.Request(f"http://{server.host}:{server.port}{path}", method=method,
                                 data=b"{}" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {server.api_key}"})
    with pytest.raises(urllib.error.HTTPError) as e:  # was plain text: "Not Found", "Method Not Allowed"
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == status and e.value.headers["content-type"] == "application/json"
    err = json.loads(e.value.read())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert f"{method} {path}" in err["message"] and "/v1/chat/completions" in err["message"]
    if allow:
        assert allow in e.value.headers["allow"] and allow in err["message"]
    ok, _ = _post(server, {"model": "solver", "messages": chat("Calculate 2 + 2.")})
    assert ok == 200


def test_the_key_guards_every_route_and_the_server_binds_locally(server):
    req = urllib.request.Request(f"http://{server.host}:{server.port}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
    assert server.host == "127.0.0.1" and server.api_key.startswith("sk-marft-") and len(server.api_key) > 30


def test_marft_serve_command_serves_until_interrupted(tiny_model_dir, tmp_path):
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "marft"
    args = [str(script), "serve", "configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}", "model.dtype=float32",
            "model.device=cpu", "rollout.max_new_tokens=4", f"output_dir={tmp_path}", "--port", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MARFT_API_KEY": "sk-test-key"})
    try:
        line = proc.stdout.readline()
        m = re.match(r"marft serve: planner, solver at (http://127\.0\.0\.1:\d+/v1) \(API key: sk-test-key\)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        client = openai.OpenAI(base_url=m.group(1), api_key="sk-test-key")
        r = client.chat.completions.create(model="solver", messages=chat("Calculate 1 + 1."))
        assert r.usage.completion_tokens <= 4  # the solver's limit: rollout.max_new_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=m.group(1), api_key="sk-other").models.list()
        port = int(m.group(1).split(":")[2].split("/")[0])
        taken = subprocess.run([*args[:-1], str(port)], capture_output=True, text=True, timeout=120)
        assert taken.returncode == 2 and "the port is in use" in taken.stderr.splitlines()[-1]
        assert "choose another --port" in taken.stderr.splitlines()[-1]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("host,why", [("256.1.1.1", "not a valid address of this machine"),
                                      ("192.0.2.1", "not a valid address of this machine"),  # TEST-NET: no one's
                                      ("no-such-host.invalid", "not a valid address of this machine")])
def test_a_host_that_is_not_this_machines_is_one_line(team_parts, host, why):
    from marft.errors import UserError
    from marft.serving.serve import TeamServer

    team, models, engine = team_parts
    server = serve_team(models, team, engine, SAMPLING, host=host, port=8000)
    with pytest.raises(UserError, match=why) as e:  # was: uvicorn's ERROR line, then "is the port in use?"
        server.start()
    assert "--host" in str(e.value) and "port is in use" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="0-65535"):
        TeamServer(team, engine, SAMPLING, None, None, port=70000).start()


def test_marft_serve_with_a_bad_host_is_one_line(tiny_model_dir, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    args = [str(Path(sys.executable).parent / "marft"), "serve", "configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}",
            "model.dtype=float32", "model.device=cpu", f"output_dir={tmp_path}", "--host", "256.1.1.1", "--port", "0"]
    got = subprocess.run(args, capture_output=True, text=True, timeout=120)
    lines = got.stderr.splitlines()
    assert got.returncode == 2 and not any(line.startswith("ERROR") for line in lines), got.stderr
    assert lines[-1].startswith("marft: error: cannot serve on 256.1.1.1:0: 256.1.1.1 is not a valid address"), lines


def test_urls_bracket_an_ipv6_host():
    from types import SimpleNamespace

    from marft.serving.serve import TeamServer
    origin = TeamServer._origin.fget
    assert origin(SimpleNamespace(host="::1", port=8000)) == "http://[::1]:8000"
    assert origin(SimpleNamespace(host="127.0.0.1", port=8000)) == "http://127.0.0.1:8000"


def test_a_runs_rollouts_sample_at_the_runs_temperature_whatever_a_request_asks(capsys, monkeypatch):
    # in a workflow's rollouts (fixed_sampling) the learner assumes the run's temperature: a request's
    # temperature and top_p are ignored there, with a warning; marft serve honours them
    from types import SimpleNamespace

    import marft.errors
    from marft.serving.serve import TeamServer
    monkeypatch.setattr(marft.errors, "WARNED", set())  # the warning is once per process
    stub = lambda fixed: SimpleNamespace(team={"solver": SimpleNamespace(max_new_tokens=0)},  # noqa: E731
                                         sampling=Sampling(1.0, 1.0, 0, 16), fixed_sampling=fixed)
    body = {"temperature": 0.2, "top_p": 0.5, "max_tokens": 4}
    served = TeamServer._sampling(stub(False), "solver", body)
    assert (served.temperature, served.top_p, served.max_new_tokens) == (0.2, 0.5, 4)
    run = TeamServer._sampling(stub(True), "solver", body)
    assert (run.temperature, run.top_p, run.max_new_tokens) == (1.0, 1.0, 4)
    assert "the workflow asks for temperature=0.2" in capsys.readouterr().err


def test_the_sampling_warning_is_said_once_per_run_not_once_per_rollout_or_setting(capsys, monkeypatch):
    # every rollout of a workflow run has its own server, training and evaluation sample at their own
    # temperatures, and a request may ask for temperature and top_p: still one warning (issue 41: 4 in 2 iterations)
    from types import SimpleNamespace

    import marft.errors
    from marft.serving.serve import TeamServer
    monkeypatch.setattr(marft.errors, "WARNED", set())
    for run_temperature in (0.7, 0.6, 0.7, 0.6):  # rollout, evaluation, rollout, evaluation
        stub = SimpleNamespace(team={"solver": SimpleNamespace(max_new_tokens=0)},
                               sampling=Sampling(run_temperature, 1.0, 0, 16), fixed_sampling=True)
        for body in ({"temperature": 0.2, "top_p": 0.5}, {"temperature": 0.9}):
            assert TeamServer._sampling(stub, "solver", body).temperature == run_temperature
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "the workflow asks for temperature=0.2" in err and "Said once per run" in err


def test_a_wrong_key_is_told_where_the_key_is(server):
    status, body = _post(server, {"model": "solver", "messages": chat("x")}, key="sk-wrong")
    message = body["error"]["message"]
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    # marft train prints no key (each rollout's endpoint has its own): the message says where one is
    assert "marft serve prints its key when it starts (MARFT_API_KEY sets it)" in message
    assert "which only the workflow's client holds" in message and "client.api_key, client.base_url" in message


# ---------------------------------------------------------------- tool calling (marft/serving/tool_calls.py)
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                        "b": {"type": "number"}}}}}
CALL_TEXT = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


class Scripted:
    """The real engine with its replies' text replaced by ``text`` (a random tiny model writes no tool
    call); keeps the chats it was given."""

    def __init__(self, engine, text):
        self.engine, self.text, self.chats = engine, text, []

    def generate(self, agent, chats, sampling, generator=None):
        self.chats += chats
        out = self.engine.generate(agent, chats, sampling, generator)
        out.texts = [self.text] * len(chats)
        return out

    def flops(self, agent, out):
        return 0.0


@pytest.fixture
def scripted(team_parts):
    team, models, engine = team_parts
    engine = Scripted(engine, CALL_TEXT)
    with serve_team(models, team, engine, SAMPLING, seed=7) as s:
        yield s, engine, models.for_agent("solver")[1]


def test_tool_calls_are_parsed_from_the_reply_and_other_blocks_stay_text():
    from marft.serving.tool_calls import parse

    content, calls = parse(CALL_TEXT + '\n<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
                           '\n<tool_call>{not json}</tool_call>\n<tool_call>{"name": "add"}</tool_call>', {"add"})
    assert [c["function"]["name"] for c in calls] == ["add", "add"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}, {}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert content.startswith("Let me add.") and '"mul"' in content and "{not json}" in content
    assert '"add"' not in content
    assert parse(CALL_TEXT, {"add"})[0] == "Let me add."
    assert parse('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n', {"add"})[0] is None  # only a call
    for text in (" no call here ", CALL_TEXT.replace("</tool_call>", "")):  # none, or one cut off: the text as it is
        assert parse(text, {"add"}) == (text, [])
    assert parse('<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>', {"add"})[1] == []


def test_tools_and_tool_turns_are_written_as_text_for_a_template_without_tools(team_parts):
    from marft.engines.generation import render_chat
    from marft.serving.serve import _messages, _tools
    from marft.serving.tool_calls import chat as tool_chat

    tok = team_parts[1].for_agent("solver")[1]
    assert "tools" not in tok.chat_template
    messages = _messages(chat("Add 1 and 2.") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}, {"role": "tool", "tool_call_id": "c2", "content": "7"}])
    assert messages[3] == {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}  # a dict, as templates take it
    rendered = tool_chat(messages, _tools([ADD], "auto"), tok)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]  # both results: one user turn
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(ADD) in rendered[0]["content"]
    assert rendered[2]["content"] == ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                                      '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    assert rendered[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>"
    assert "<tool_response>\n3\n</tool_response>" in render_chat(tok, rendered)
    # no system message: the tools get one; tool_choice none: not shown, the tool turns still written
    assert tool_chat(messages[1:], _tools([ADD], None), tok)[0]["content"].startswith("# Tools")
    hidden = tool_chat(messages, _tools([ADD], "none"), tok)
    assert hidden[0] == messages[0] and hidden[3] == rendered[3]
    plain = chat("Add 1 and 2.")  # nothing about tools: the very messages, rendered as before
    assert tool_chat(plain, None, tok) is plain and tool_chat(plain, _tools(None, "auto"), tok) is plain


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_shows_tools_is_given_them(scripted):
    # a tool-use model's template renders the tools and tool turns itself: it gets them as transformers passes them
    server, engine, tok = scripted
    before = tok.chat_template
    tok.chat_template = TOOL_TEMPLATE
    try:
        messages = chat("Add 1 and 2.") + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}]
        ok, reply = _post(server, {"model": "solver", "messages": messages, "tools": [ADD]})
        assert ok == 200 and reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add", reply
        (call,) = server.calls()
        prompt = tok.decode(call.prompt_ids)
        assert prompt.startswith("<|im_start|>system\nTOOLS add<|im_end|>") and "<tool_call>" not in prompt
        assert 'CALL add {"a": 1}' in prompt and "<|im_start|>tool\n3<|im_end|>" in prompt  # arguments a dict
        assert engine.chats[-1].tools == [ADD]
        ok, reply = _post(server, {"model": "solver", "messages": messages, "tools": [ADD], "tool_choice": "none"})
        assert ok == 200 and "TOOLS" not in tok.decode(server.calls()[-1].prompt_ids)
    finally:
        tok.chat_template = before


def test_a_reply_with_a_tool_call_reaches_the_openai_client_and_the_result_comes_back(scripted):
    server, engine, tok = scripted
    client = openai.OpenAI(base_url=server.base_url("tools"), api_key=server.api_key)
    messages = chat("Add 1 and 2.")
    r = client.chat.completions.create(model="solver", messages=messages, tools=[ADD])
    choice = r.choices[0]
    (call,) = server.calls("tools")
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments) == {"a": 1, "b": 2}
    assert call.text == CALL_TEXT and call.messages == messages  # the call recorded as the model wrote it
    prompt = tok.decode(call.prompt_ids)
    assert json.dumps(ADD) in prompt and "<tool_call>" in prompt  # the tools shown
    # the program answers with the tool's result: an assistant message with tool_calls (content null) and a tool message
    messages += [choice.message.model_dump(exclude_none=True) | {"content": None},
                 {"role": "tool", "tool_call_id": tool_call.id, "content": "3"}]
    client.chat.completions.create(model="solver", messages=messages, tools=[ADD])
    second = server.calls("tools")[1]
    prompt = tok.decode(second.prompt_ids)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\n3\n</tool_response>" in prompt and second.messages[3]["tool_call_id"] == tool_call.id
    # the prompt recorded is the one the engine was given
    from marft.engines.generation import encode_chats
    ids, mask = encode_chats(tok, [engine.chats[-1]], "cpu")
    assert second.prompt_ids == ids[0][mask[0]].tolist()
    # tool_choice none: no tools shown, the reply's block is text; no tools: the same
    for fields in ({"tools": [ADD], "tool_choice": "none"}, {}):
        r = client.chat.completions.create(model="solver", messages=chat("Add."), **fields)
        assert r.choices[0].message.content == CALL_TEXT and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason in ("stop", "length")
        assert "<tools>" not in tok.decode(server.calls("tools")[-1].prompt_ids)


def test_a_request_without_tools_renders_as_before(server, team_parts):
    tok = team_parts[1].for_agent("solver")[1]
    from marft.engines.generation import encode_chats
    ids, mask = encode_chats(tok, [chat("Calculate 1 + 2.")], "cpu")
    for i, fields in enumerate(({}, {"tools": None, "tool_choice": None}, {"tool_choice": "auto"}, {"tools": []})):
        ok, reply = _post(server, {"model": "solver", "messages": chat("Calculate 1 + 2."), **fields},
                          path=f"/episodes/plain{i}/v1/chat/completions")
        assert ok == 200 and "tool_calls" not in reply["choices"][0]["message"], reply
        assert server.calls(f"plain{i}")[0].prompt_ids == ids[0][mask[0]].tolist()


def test_a_response_format_is_asked_for_in_the_system_message_and_text_changes_nothing(scripted, team_parts, capsys):
    """Structured output is an instruction, not a constraint: the schema reaches the system message
    (one warning says it is not enforced); ``type: text`` and null render as no format."""
    server, engine, tok = scripted
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    formats = [{"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
               {"type": "json_object"}, {"type": "text"}, None]
    for fmt in formats:
        ok, _ = _post(server, {"model": "solver", "messages": chat("Calculate 1 + 2."), "response_format": fmt})
        assert ok == 200
    schema_chat, object_chat, text_chat, none_chat = engine.chats[-4:]
    assert schema_chat[0]["content"] == "Be brief.\n\nReply with one JSON object and nothing else, matching this JSON schema:\n" + json.dumps(schema)
    assert object_chat[0]["content"] == "Be brief.\n\nReply with one JSON object and nothing else."
    assert text_chat == none_chat == chat("Calculate 1 + 2.") and schema_chat[1:] == text_chat[1:]
    assert "does not constrain sampling" in capsys.readouterr().err


def _bad(**fields):
    return {"model": "solver", "messages": chat("x"), **fields}


NOT_JSON = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{1"}}  # arguments not JSON


@pytest.mark.parametrize("body,param", [
    (_bad(tools={"add": ADD}), "tools"),
    (_bad(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
    (_bad(tools=[{"type": "retrieval"}]), "tools"),
    (_bad(tools=[ADD, ADD]), "tools"),
    (_bad(tools=[{"type": "function", "function": {"name": "f", "parameters": "a schema"}}]), "tools"),
    (_bad(tools=[ADD], tool_choice="required"), "tool_choice"),
    (_bad(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}}), "tool_choice"),
    (_bad(tools=[ADD], tool_choice=3), "tool_choice"),
    (_bad(response_format={"type": "xml"}), "response_format"),
    (_bad(response_format="json"), "response_format"),
    (_bad(response_format={"type": "json_schema"}), "response_format"),
    (_bad(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": "an object"}}), "response_format"),
    (_bad(messages=[{"role": "tool", "content": "3"}]), "messages[0].tool_call_id"),
    (_bad(messages=[{"role": "tool", "tool_call_id": "c1", "content": None}]), "messages[0].content"),
    (_bad(messages=[{"role": "assistant", "content": None}]), "messages[0].content"),
    (_bad(messages=[{"role": "assistant", "content": None, "tool_calls": []}]), "messages[0].content"),
    (_bad(messages=[{"role": "assistant", "tool_calls": {"id": "c1"}}]), "messages[0].tool_calls"),
    (_bad(messages=[{"role": "assistant", "tool_calls": [NOT_JSON]}]), "messages[0].tool_calls[0]"),
    (_bad(messages=[{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]),
     "messages[0].tool_calls[0]"),
    (_bad(messages=[{"role": "assistant", "tool_calls": [{"id": "c1", "function": {  # was a 500 (RecursionError)
        "name": "add", "arguments": "[" * 100000 + "]" * 100000}}]}]), "messages[0].tool_calls[0]"),
])
def test_bad_tools_get_openai_errors_and_the_endpoint_goes_on(server, body, param):
    got, reply = _post(server, body)
    assert got == 400 and reply["error"]["param"] == param and reply["error"]["message"], reply
    ok, reply = _post(server, {"model": "solver", "messages": chat("Calculate 2 + 2.")})
    assert ok == 200


def test_a_json_object_format_with_a_stray_json_schema_key_is_a_json_object(scripted):
    # was a 500: the schema was read from "json_schema" whatever the type ('int' object has no attribute 'get')
    server, engine, tok = scripted
    for stray in (3, None, {"schema": {"type": "object"}}):
        ok, reply = _post(server, {"model": "solver", "messages": chat("Calculate 1 + 2."),
                                   "response_format": {"type": "json_object", "json_schema": stray}})
        assert ok == 200, reply
        assert engine.chats[-1][0]["content"] == "Be brief.\n\nReply with one JSON object and nothing else."


def test_json_nested_past_what_the_server_can_walk_is_a_400(server, monkeypatch):
    # nesting json.loads accepts can still overflow the stack later (the tools' listing, an error's repr)
    import marft.serving.serve

    def overflow(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded while encoding a JSON object")

    monkeypatch.setattr(marft.serving.serve.tool_calls, "chat", overflow)
    got, reply = _post(server, _bad(tools=[ADD]))
    assert got == 400 and "nested too deeply" in reply["error"]["message"], reply  # was a 500


RAISING_TEMPLATE = TOOL_TEMPLATE.replace("{% for m in messages %}", "{% for m in messages %}{% if 'BOOM' in m.content %}"
                                         "{{ raise_exception('Conversation roles must alternate') }}"
                                         "{% endif %}")


def test_messages_the_chat_template_rejects_fail_alone_not_their_batch(team_parts):
    # a template's raise_exception (roles out of order, more tool calls than it takes) failed the whole
    # batch with a 500 "generation failed": every other episode's request with it
    team, models, engine = team_parts
    tok = models.for_agent("solver")[1]
    before = tok.chat_template
    tok.chat_template = RAISING_TEMPLATE
    got = {}
    try:
        with serve_team(models, team, engine, SAMPLING, ready=lambda waiting: sum(waiting.values()) == 2) as server:
            def ask(episode, text):
                got[episode] = _post(server, {"model": "solver", "messages": chat(text)},
                                     path=f"/episodes/{episode}/v1/chat/completions")

            asks = (("bad", "BOOM"), ("good", "Calculate 1 + 2."))
            threads = [threading.Thread(target=ask, args=a) for a in asks]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert server.batches == [("solver", 1)] and server.calls("bad") == [] and len(server.calls("good")) == 1
    finally:
        tok.chat_template = before
    status, reply = got["bad"]
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert "Conversation roles must alternate" in reply["error"]["message"]
    status, reply = got["good"]
    assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant", reply


class _Capped:
    """The real engine with a context limit of its own, as vLLM's max_model_len."""

    def __init__(self, engine, max_model_len):
        self.engine, self.max_model_len = engine, max_model_len

    def generate(self, agent, chats, sampling, generator=None):
        # vLLM's submit raises mid-batch (a 500 for the batch), leaving the requests before it in the engine
        raise AssertionError("a prompt over the engine's limit reached it")

    def flops(self, agent, out):
        return 0.0


def test_a_prompt_over_the_engines_own_limit_is_refused_as_over_the_context(team_parts):
    # the context was the model's max_position_embeddings (2048 here, 32768 for Qwen2.5) even on vLLM,
    # whose max_model_len (4096 by default) is less: its UserError failed the batch with a 500
    team, models, engine = team_parts
    with serve_team(models, team, _Capped(engine, 64), SAMPLING) as server:
        got, reply = _post(server, {"model": "solver", "messages": chat("word " * 60)})
    assert got == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert "maximum context length is 64 tokens" in reply["error"]["message"]


# ---------------------------------------------------------------- streaming (stream: true)
def _post_stream(server, body, path="/v1/chat/completions"):
    """A streamed request over plain HTTP: its status, Content-Type and Server-Sent Events' data."""
    req = urllib.request.Request(f"http://{server.host}:{server.port}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {server.api_key}",
                                                         "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
        events = text.split("\n\n")
        assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), text
        return r.status, r.headers["Content-Type"], [e[len("data: "):] for e in events[:-1]]


def test_a_streamed_reply_is_the_unstreamed_one_in_chat_completion_chunks(server):
    whole, call = _greedy(server, "whole")
    ok, reply = _post(server, {"model": "solver", "messages": chat("Calculate 1 + 2."), "temperature": 0,
                               "stream": False}, path="/episodes/whole/v1/chat/completions")
    assert ok == 200 and reply["choices"][0] == whole  # stream: false (and null, _greedy's) as before
    client = openai.OpenAI(base_url=server.base_url("streamed"), api_key=server.api_key)
    chunks = list(client.chat.completions.create(model="solver", messages=chat("Calculate 1 + 2."), temperature=0,
                                                 stream=True))
    assert {(c.id, c.created, c.model, c.object) for c in chunks} == {
        (chunks[0].id, chunks[0].created, "solver", "chat.completion.chunk")}
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole["message"]["content"]
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole["finish_reason"]
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    (streamed,) = server.calls("streamed")
    for name in ("messages", "prompt_ids", "response_ids", "text", "truncated", "sampling"):
        assert getattr(streamed, name) == getattr(call, name), name
    assert streamed.logprobs == pytest.approx(call.logprobs)
    # include_usage: one more chunk, no choices, the usage of the unstreamed reply; the others usage null
    ok, reply = _post(server, {"model": "solver", "messages": chat("Calculate 1 + 2."), "temperature": 0},
                      path="/episodes/usage0/v1/chat/completions")
    chunks = list(client.chat.completions.create(model="solver", messages=chat("Calculate 1 + 2."), temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude_none=True) == reply["usage"]
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks[:-1])
    # on the wire: text/event-stream, data: lines, [DONE] last; include_usage false or null: no usage chunk
    for options in ({"include_usage": False}, None, {}):
        status, kind, data = _post_stream(server, {"model": "solver", "messages": chat("Calculate 1 + 2."),
                                                   "temperature": 0, "stream": True, "stream_options": options})
        assert status == 200 and kind.startswith("text/event-stream") and data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": whole["message"]["content"]}
        assert chunks[-1]["choices"][0]["delta"] == {} and "usage" not in chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


def _langchain_message(chunks):
    """The message LangChain's ChatOpenAI makes of streamed chunks: each delta as an AIMessageChunk, summed."""
    messages = pytest.importorskip("langchain_core.messages")
    from langchain_core.messages.tool import tool_call_chunk
    total = None
    for c in chunks:
        for choice in c.choices:
            d = choice.delta
            part = messages.AIMessageChunk(content=d.content or "", tool_call_chunks=[
                tool_call_chunk(name=t.function.name, args=t.function.arguments, id=t.id, index=t.index)
                for t in d.tool_calls or []])
            total = part if total is None else total + part
    return total


@pytest.mark.parametrize("text", [CALL_TEXT, CALL_TEXT.split("\n", 1)[1] + "\n" + CALL_TEXT.split("\n", 1)[1].replace(
    '"a": 1', '"a": 5')])
def test_a_streamed_tool_call_is_reassembled_by_the_openai_client(scripted, text):
    # the second reply is only tool calls, two of them: content null, the first call with the role
    server, engine, tok = scripted
    engine.text = text
    client = openai.OpenAI(base_url=server.base_url("tools"), api_key=server.api_key)
    ask = {"model": "solver", "messages": chat("Add 1 and 2."), "tools": [ADD], "temperature": 0}
    r = client.chat.completions.create(**ask).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.tool_calls, r
    with client.chat.completions.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == r.message.content
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in final.message.tool_calls] == [
        (t.type, t.function.name, json.loads(t.function.arguments)) for t in r.message.tool_calls]
    assert all(len(t.id) == 9 and t.id.isalnum() for t in final.message.tool_calls)  # as Mistral's templates require
    assert not {t.id for t in final.message.tool_calls} & {t.id for t in r.message.tool_calls}  # another call, other ids
    assert len([e for e in events if e.type == "tool_calls.function.arguments.done"]) == len(r.message.tool_calls)
    first, second = server.calls("tools")  # greedy: the same reply, recorded the same
    assert first.text == second.text == text and second.response_ids == first.response_ids
    # as LangChain accumulates the deltas (ChatOpenAI(streaming=True)): the same calls
    chunks = list(client.chat.completions.create(**ask, stream=True))
    message = _langchain_message(chunks)
    assert message.content == (r.message.content or "")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in r.message.tool_calls]


def test_chatopenai_streaming_gets_the_same_text(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    whole, _ = _greedy(server, "whole")
    llm = langchain_openai.ChatOpenAI(model="solver", base_url=server.base_url("lc"), api_key=server.api_key,
                                      temperature=0, streaming=True)
    assert llm.invoke(chat("Calculate 1 + 2.")).content == whole["message"]["content"]
    assert "".join(c.content for c in llm.stream(chat("Calculate 1 + 2."))) == whole["message"]["content"]
