"""The team behind an OpenAI-compatible endpoint (marft/serve.py), through the real `openai`
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
from marft.config import load_config  # noqa: E402
from marft.engines import make_engine  # noqa: E402
from marft.generation import Sampling  # noqa: E402
from marft.serve import serve_team  # noqa: E402

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
    with serve_team(models, team, engine, SAMPLING, ready=lambda n: n == 4) as server:
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
    ({"model": "solver", "messages": chat("x"), "stream": True}, None, 400, "stream"),
    ({"model": "solver", "messages": chat("x"), "n": 2}, None, 400, "n"),
    ({"model": "solver", "messages": chat("x"), "temperature": 9}, None, 400, "temperature"),
    ({"model": "solver", "messages": chat("x"), "max_tokens": 0}, None, 400, "max_tokens"),
    ({"model": "solver", "messages": chat("x"), "stop": ["a", "b", "c", "d", "e"]}, None, 400, "stop"),
    ({"model": "solver", "messages": chat("x"), "stop": ""}, None, 400, "stop"),
    ({"model": "solver", "messages": chat("x"), "stop": ["a", ""]}, None, 400, "stop"),
    ({"model": "solver", "messages": chat("x"), "stop": 3}, None, 400, "stop"),
    ({"model": "solver", "messages": chat("word " * 3000)}, None, 400, "context_length_exceeded"),
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


def test_a_stop_string_is_found_in_the_decoded_prefix_and_drops_the_end_of_turn_token(team_parts):
    # "é" is two byte-level tokens (neither decodes to it alone); a stop string that ends the text
    # leaves the end-of-turn token after it out of the call
    from marft.serve import Call, _cut_at_stop

    tok = team_parts[1].for_agent("solver")[1]
    ids = tok.encode("The answer é is 19.", add_special_tokens=False) + [tok.eos_token_id]
    call = Call("e", 0, "solver", chat("x"), [1, 2], ids, [-0.5] * len(ids), False,
                tok.decode(ids, skip_special_tokens=True), SAMPLING, 0.0, 0.0)
    cut = _cut_at_stop(call, ("é",), tok)
    assert cut.text == "The answer " and tok.decode(cut.response_ids).endswith("é")
    assert cut.response_ids == ids[:len(cut.response_ids)] and "é" not in tok.decode(cut.response_ids[:-1])
    assert len(tok.encode("é", add_special_tokens=False)) == 2 and len(cut.logprobs) == len(cut.response_ids)
    end = _cut_at_stop(call, ("19.",), tok)
    assert end.response_ids == ids[:-1] and end.logprobs == call.logprobs[:-1] and end.text == "The answer é is "
    assert _cut_at_stop(call, ("20",), tok) is call


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
    from marft.serve import TeamServer

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

    from marft.serve import TeamServer
    origin = TeamServer._origin.fget
    assert origin(SimpleNamespace(host="::1", port=8000)) == "http://[::1]:8000"
    assert origin(SimpleNamespace(host="127.0.0.1", port=8000)) == "http://127.0.0.1:8000"


def test_a_runs_rollouts_sample_at_the_runs_temperature_whatever_a_request_asks(capsys):
    # in a workflow's rollouts (fixed_sampling) the learner assumes the run's temperature: a request's
    # temperature and top_p are ignored there, with a warning; marft serve honours them
    from types import SimpleNamespace

    from marft.serve import TeamServer
    stub = lambda fixed: SimpleNamespace(team={"solver": SimpleNamespace(max_new_tokens=0)},  # noqa: E731
                                         sampling=Sampling(1.0, 1.0, 0, 16), fixed_sampling=fixed)
    body = {"temperature": 0.2, "top_p": 0.5, "max_tokens": 4}
    served = TeamServer._sampling(stub(False), "solver", body)
    assert (served.temperature, served.top_p, served.max_new_tokens) == (0.2, 0.5, 4)
    run = TeamServer._sampling(stub(True), "solver", body)
    assert (run.temperature, run.top_p, run.max_new_tokens) == (1.0, 1.0, 4)
    assert "the workflow asks for temperature=0.2" in capsys.readouterr().err
