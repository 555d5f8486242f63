"""The team behind an OpenAI-compatible HTTP API, for agent programs that marft does not drive.

A :class:`TeamServer` serves ``GET /v1/models`` (one model per agent, named as the agent) and
``POST /v1/chat/completions`` on 127.0.0.1 (by default) with a random API key per server. Each
agent answers with its own LoRA adapter through the run's engine, so a program written with the
``openai`` client (or any framework that speaks this protocol) calls the agents by name and marft
records every call: the agent, the chat, the prompt's token ids as the learner renders them, the
reply's ids and their behaviour log-probabilities, truncation and time, in call order, per episode.

Episodes: a program given ``server.base_url(episode)`` (``.../episodes/<episode>/v1``) has its
calls recorded under that episode (:meth:`TeamServer.calls`); ``.../v1`` alone records under
``"default"``. After :meth:`TeamServer.close_episode` (its workflow returned) an episode's waiting
and later requests are refused (400, code ``episode_ended``) and none of its calls is recorded.

Batching: requests are collected and generated together, one batch per agent and sampling
setting, by one worker (the engine runs one batch at a time). A batch starts when ``ready(waiting)``
says so, ``waiting`` mapping each episode to its number of requests waiting (the workflow runner,
:mod:`marft.serving.workflow`, makes it "every running episode is blocked on its calls", which makes the
batches, and so the replies, the same from run to run, parallel calls or not), or when a request has
waited ``patience_s`` (an episode busy elsewhere, with a tool, does not hold the others back for
ever); without ``ready``, when no new request has come for ``wait_s`` seconds.

Rounds: every reply carries the header ``x-marft-round``, the number of the episode's batch that
answered it (1, 2, ...). A client that sends ``x-marft-round`` (the highest it has received) and
``x-marft-seq`` (its own count of the calls it made) with each request has its calls recorded with
them (``Call.round``, ``Call.seq``; the workflow runner's clients do): calls with the same round were
made before any of the others' replies came back, so none depends on another. Without the headers a
call's round is the number of the episode's batches answered when it arrived, and its seq its
arrival. Within a batch requests are ordered by episode, round, the agent's place in the team, the
messages and seq, not by arrival. The batches are generated in a worker thread, or,
while a thread runs :meth:`TeamServer.pump` (the workflow runner's, which holds the model for the
learner too), in that thread: torch on a CPU is about 1.5x slower for every thread once two threads
have run its operations (each brings its own OpenMP team onto the same cores), so a training run
keeps all of them in one.

Sampling settings a request carries are honoured within the run's limits: ``max_tokens`` (or
``max_completion_tokens``) at most the agent's reply limit (larger values are cut to it),
``temperature`` 0-2, ``top_p`` in (0, 1] (not in a workflow's rollouts, ``fixed_sampling``: there
the run's temperature and top_p, which the learner's log-probabilities assume, with one warning),
``stop`` (a string or a list of up to 4 non-empty strings, beside the run's ``rollout.stop``: the
engine ends the reply at the token that completes one, as vLLM does, and the recorded call keeps the
tokens up to it with their log-probabilities; the content returned ends before the stop string,
``finish_reason`` "stop", as OpenAI's; requests with other stop strings are other batches);
``logprobs: true`` returns each sampled token's text and behaviour log-probability (what the call
records; ``top_logprobs`` above 0 is a 400: the alternatives are not kept); ``logit_bias``,
``frequency_penalty``, ``presence_penalty`` and ``seed`` are accepted and not applied, with one
warning; everything else is the run's.

Tools (:mod:`marft.serving.tool_calls`): a request's ``tools`` are shown to the model (not with ``tool_choice``
"none"; "auto" is the other one accepted, a forced call is a 400), by the chat template where it
renders tools itself, else as a system paragraph in the Hermes / Qwen2.5 convention; an assistant
message's ``tool_calls`` (its content may be null) and ``role: "tool"`` results are rendered the same
way (as ``<tool_call>`` and ``<tool_response>`` text without such a template). The reply's
``<tool_call>`` blocks that name one of the request's functions with JSON arguments come back as
``message.tool_calls`` (``finish_reason`` "tool_calls"; ids of 9 letters and digits, as Mistral's
templates require, the same for the same episode and call in every run: a hash of them, in
``marft serve`` with the server's key), the rest of the text as the content; the
recorded call keeps the prompt's ids as the engine rendered them and the reply's tokens as sampled,
blocks included: the learner trains on the calls as the model wrote them.

Structured output: a ``response_format`` of ``json_object`` or ``json_schema`` is asked for in the
system message (the schema shown) and not enforced (no constrained sampling; one warning says so):
the reply is what the model writes, and training can teach the format.

Streaming: ``stream: true`` is answered with Server-Sent Events (``text/event-stream``) in OpenAI's
``chat.completion.chunk`` format, for the frameworks that stream by default or in common modes.
Replies are generated whole, so the stream is sent once the reply is ready: the reply arrives at
once, with no gain in time to the first token. The chunks (one ``id``, ``created`` and ``model``):
the role with the whole content (null when the reply is only tool calls), each tool call whole with
its ``index``, an empty delta with the ``finish_reason`` of the unstreamed reply, with
``stream_options: {"include_usage": true}`` one more with ``choices: []`` and the ``usage``, then
``data: [DONE]``. The recorded call is the same either way; a refused request is a JSON error, never
a stream.

Errors are OpenAI-shaped
JSON (``{"error": {"message", "type", "param", "code"}}``) with a 4xx status, never a crash of the
run: a wrong or missing key (401), an unknown model or path (404), a wrong method (405), a malformed
body (malformed ``tools``, ``tool_choice`` or ``stream_options`` included, and ``stream_options``
without ``stream: true``, as OpenAI's; JSON nested too deeply; no ``model``), ``n`` other than 1, messages the agent's
chat template cannot render (that request alone, not its batch) or a prompt longer than the model's
context (vLLM's ``max_model_len`` where shorter) (400). A field sent as ``null`` is a field not sent
(``n: null`` is 1, ``max_completion_tokens: null`` leaves ``max_tokens`` in force). A host that is not
an address of this machine, or a port in use, is a :class:`marft.errors.UserError` from
:meth:`TeamServer.start` saying which.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import errno
import hashlib
import secrets
import socket
import threading
import time
from dataclasses import astuple, dataclass, field, replace
from typing import Callable

import torch

from . import tool_calls
from ..errors import UserError, warn_once
from ..engines.generation import Sampling, render_chat


@dataclass
class Call:
    """One chat completion an episode asked for, as the learner needs it."""

    episode: str
    index: int  # its place among the episode's calls
    agent: str
    messages: list[dict]
    prompt_ids: list[int]
    response_ids: list[int]  # with the end-of-turn token when the reply ended on one
    logprobs: list[float]  # behaviour log-probabilities, one per response token
    truncated: bool
    text: str
    sampling: Sampling
    started: float  # time.monotonic() when the request arrived
    seconds: float  # until its reply was ready
    round: int = 0  # the episode's batches whose replies it had when it made the call (see TeamServer)
    seq: int = -1  # its place among the episode's calls as its client made them (-1: not stamped)
    version: int | None = None  # the adapter version that answered it (asynchronous training); None: the current one
    stamped: bool = False  # round and seq came from its client (x-marft-round, x-marft-seq)
    tokens: list[str] | None = None  # each response token's text, where the request asked for logprobs


@dataclass
class _Pending:
    episode: str
    index: int
    agent: str
    messages: list[dict]
    chat: list[dict]  # what the engine renders: the messages with the request's tools (marft.serving.tool_calls)
    sampling: Sampling
    started: float
    future: asyncio.Future = field(repr=False)
    stop: tuple[str, ...] = ()  # the request's own stop strings (also in sampling): the content returned ends before them
    round: int = 0  # as Call.round
    seq: int = -1  # as Call.seq
    answered: int = 0  # the episode's batch that answers it (1, 2, ...): its reply's x-marft-round header
    stamped: bool = False  # as Call.stamped
    logprobs: bool = False  # the request asked for its tokens' log-probabilities


class _Refused(Exception):
    """A request answered with an OpenAI-style error."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers: dict | None = None


class TeamServer:
    """An OpenAI-compatible endpoint for the team ``team`` on ``engine`` (see the module docstring).

    ``sampling`` is the run's (its ``max_new_tokens`` the default reply limit; an agent's own
    ``max_new_tokens`` overrides it); ``tokenizer(agent)`` and ``context(agent)`` give the agent's
    tokenizer and context length (positions); ``seed`` seeds the sampling generator; with
    ``owns_engine``, :meth:`stop` closes the engine as well.
    Use as a context manager, or :meth:`start` / :meth:`stop`.
    """

    def __init__(self, team, engine, sampling: Sampling, tokenizer: Callable, context: Callable[[str], int],
                 api_key: str | None = None, host: str = "127.0.0.1", port: int = 0, seed: int = 0,
                 ready: Callable[[dict[str, int]], bool] | None = None, wait_s: float = 0.02, patience_s: float = 5.0,
                 owns_engine: bool = False, fixed_sampling: bool = False):
        self.team, self.engine, self.sampling = team, engine, sampling
        # a workflow's rollouts: the run's temperature and top_p whatever a request asks (the learner's
        # log-probabilities are the policy at the run's temperature; samples from another are off-policy)
        self.fixed_sampling = fixed_sampling
        self.owns_engine = owns_engine  # stop() closes the engine too
        self.tokenizer, self.context = tokenizer, context
        self.api_key = api_key or "sk-marft-" + secrets.token_hex(16)
        self.host, self.port = host, port
        self.ready, self.wait_s, self.patience_s = ready, wait_s, patience_s
        self.generator = torch.Generator().manual_seed(seed)
        self._calls: dict[str, list[Call]] = {}
        self._counts: dict[str, int] = {}
        self._rounds: dict[str, int] = {}  # episode -> its batches answered so far
        self._closed: set[str] = set()  # episodes that ended (close_episode): their calls are refused, not recorded
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()  # the records, read from other threads
        self._jobs: queue.Queue | None = None  # while a thread pumps: the batches it is to generate
        self._jobs_lock = threading.Lock()
        self._server = self._thread = self._loop = self._wake = None
        self.batches: list[tuple[str, int]] = []  # (agent, size) of every batch generated, in order
        self.impatient = 0  # batches started because a request waited patience_s, not because ready said so
        self.gen_seconds = 0.0  # time in the engine's generate, summed (MFU)
        self.gen_flops = 0.0  # FLOPs those batches needed (marft.engines.flops)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "TeamServer":
        """Serve (a started server is left as it is: ``with server.start():`` works)."""
        import uvicorn

        if self._server is not None and self._server.started:
            return self

        sockets = _bind(self.host, self.port)  # bound here: a wrong host or a taken port is one clear line
        config = uvicorn.Config(self.app(), host=self.host, port=self.port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": sockets}, name="marft-serve",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                for sock in sockets:
                    sock.close()
                raise RuntimeError(f"the endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
        if self.owns_engine:
            self.engine.close()

    def __enter__(self) -> "TeamServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"{self._origin}/v1"

    @property
    def _origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address: http://[::1]:8000
        return f"http://{host}:{self.port}"

    def base_url(self, episode: str | int) -> str:
        """The base URL whose calls are recorded under ``episode``."""
        return f"{self._origin}/episodes/{episode}/v1"

    def calls(self, episode: str | int = "default") -> list[Call]:
        """The calls recorded for ``episode``, in the order they were made."""
        with self._lock:
            return sorted(self._calls.get(str(episode), []), key=lambda c: c.index)

    def poke(self) -> None:
        """Something ``ready`` reads changed (an episode ended): look at the waiting requests again,
        and have a running :meth:`pump` look at its ``done()``."""
        self._in_loop(self._wake.set)
        with self._jobs_lock:
            if self._jobs is not None:
                self._jobs.put(None)

    def _in_loop(self, fn, *args) -> None:
        """``fn(*args)`` on the event loop's thread; nothing once the endpoint has stopped (an
        abandoned episode's thread may end after that)."""
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                self._loop.call_soon_threadsafe(fn, *args)

    def pump(self, done: Callable[[], bool], poll_s: float = 0.05) -> None:
        """Generate the endpoint's batches in the calling thread until ``done()`` (checked every
        ``poll_s`` seconds, and at once after :meth:`poke`); without a pump they run in a worker
        thread. Batches left when it returns fail (their episodes were abandoned)."""
        jobs: queue.Queue = queue.Queue()
        with self._jobs_lock:
            self._jobs = jobs
        try:
            while not done():
                try:
                    job = jobs.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if job is not None:
                    self._run_job(*job)
        finally:
            with self._jobs_lock:
                self._jobs = None
            while not jobs.empty():
                job = jobs.get()
                if job is not None:
                    self._in_loop(_settle, job[2], None, RuntimeError("the episode was abandoned"))

    def _run_job(self, fn, args, future) -> None:
        try:
            result, error = fn(*args), None
        except Exception as e:  # noqa: BLE001 - handed to the request's coroutine
            result, error = None, e
        self._in_loop(_settle, future, result, error)

    async def _in_generation_thread(self, fn, *args):
        """``fn(*args)`` in the pumping thread if there is one, else in a worker thread."""
        loop = asyncio.get_running_loop()
        with self._jobs_lock:
            if self._jobs is not None:
                future = loop.create_future()
                self._jobs.put((fn, args, future))
            else:
                future = loop.run_in_executor(None, fn, *args)
        return await future

    def close_episode(self, episode: str | int) -> None:
        """``episode`` has ended (its workflow returned, or was abandoned): its requests still waiting
        and any it sends later are refused (400), and none of its calls is recorded any more."""
        episode = str(episode)
        with self._lock:
            self._closed.add(episode)
        self._in_loop(self._refuse_closed)

    def _refuse_closed(self) -> None:
        keep = []
        for p in self._pending:
            if p.episode in self._closed:
                _settle(p.future, None, _ended(p.episode))
            else:
                keep.append(p)
        self._pending = keep

    def forget(self, episode: str | int) -> None:
        with self._lock:
            self._calls.pop(str(episode), None)
            self._counts.pop(str(episode), None)
            self._rounds.pop(str(episode), None)

    # ---------------------------------------------------------------- the HTTP side
    def app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        def refused(e: _Refused) -> JSONResponse:
            body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
            return JSONResponse(body, status_code=e.status, headers=e.headers)

        async def guarded(request, handler):
            try:
                self._check_key(request)
                out = await handler(request)
            except _Refused as e:
                return refused(e)
            except RecursionError:  # JSON nested past what json, repr and the templates can walk
                return refused(_Refused(400, "the request body is nested too deeply"))
            answered = getattr(request.state, "answered", None)  # a chat's batch: x-marft-round (module docstring)
            headers = {} if answered is None else {"x-marft-round": str(answered)}
            if isinstance(out, _Events):  # stream: true; the reply is whole by now, so is the stream
                return StreamingResponse(iter(out), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
            return JSONResponse(out, headers=headers or None)

        async def models(request):
            return await guarded(request, self._models)

        async def chat(request):
            return await guarded(request, self._chat)

        routes_text = "GET /v1/models and POST /v1/chat/completions (or the same under /episodes/<episode>/v1)"

        async def http_error(request, exc: HTTPException):  # no such path (404), a wrong method (405)
            where = f"{request.method} {request.url.path}"
            if exc.status_code == 405:
                allowed = (exc.headers or {}).get("Allow", "")
                e = _Refused(405, f"Method not allowed ({where}): use {allowed or 'another method'} there; "
                                  f"this endpoint serves {routes_text}", code="method_not_allowed")
            elif exc.status_code == 404:
                e = _Refused(404, f"Invalid URL ({where}): this endpoint serves {routes_text}", code="unknown_url")
            else:
                e = _Refused(exc.status_code, f"{exc.detail} ({where})")
            e.headers = exc.headers
            return refused(e)

        async def server_error(request, exc: Exception):  # a bug of marft's: still an OpenAI-shaped 500
            return refused(_Refused(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            worker = asyncio.create_task(self._batcher())
            yield
            worker.cancel()

        routes = [Route(p + "/models", models, methods=["GET"]) for p in ("/v1", "/episodes/{episode}/v1")]
        routes += [Route(p + "/chat/completions", chat, methods=["POST"]) for p in ("/v1", "/episodes/{episode}/v1")]
        return Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={HTTPException: http_error, Exception: server_error})

    def _check_key(self, request) -> None:
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise _Refused(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'. marft serve prints "
                                "its key when it starts (MARFT_API_KEY sets it); in a training or evaluation run each "
                                "rollout's endpoint has a new key, which only the workflow's client holds: make every "
                                "client from it (client.api_key, client.base_url)", code="invalid_api_key")

    async def _models(self, request) -> dict:
        return {"object": "list", "data": [{"id": a, "object": "model", "created": 0, "owned_by": "marft"}
                                           for a in self.team.names]}

    async def _chat(self, request) -> dict | _Events:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as e:
            raise _Refused(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise _Refused(400, "the request body must be a JSON object")
        agent = body.get("model")
        if agent is None:
            raise _Refused(400, f"you must provide a model parameter: one of this team's agents, {', '.join(self.team.names)}",
                           param="model", code="missing_required_parameter")
        if agent not in self.team.names:
            raise _Refused(404, f"The model {agent!r} does not exist: this team's models are its agents, "
                                f"{', '.join(self.team.names)}", param="model", code="model_not_found")
        stream = _stream(body.get("stream"), body.get("stream_options"))
        n = body.get("n")  # null: not given (1), as OpenAI takes it
        if n is not None and (isinstance(n, bool) or n != 1):
            raise _Refused(400, f"n must be 1 (one reply per request), got {n!r}", param="n")
        messages = _messages(body.get("messages"))
        tools = _tools(body.get("tools"), body.get("tool_choice"))
        response_format = _response_format(body.get("response_format"))
        sampling = self._sampling(agent, body)
        stop = _stop_strings(body.get("stop"))
        if stop:  # the engine ends the reply at the token completing one (the run's own stop strings still count)
            sampling = replace(sampling, stop=tuple(dict.fromkeys(sampling.stop + stop)))
        want_logprobs = _logprobs(body.get("logprobs"), body.get("top_logprobs"))
        ignored = [k for k in _IGNORED if body.get(k) is not None]
        if ignored:
            warn_once(f"warning: the endpoint ignores {', '.join(ignored)} (the replies are sampled from the agent's "
                      "policy as it is, which training's log-probabilities assume); said once per process",
                      key="ignored_fields")
        episode = request.path_params.get("episode", "default")
        with self._lock:
            if episode in self._closed:
                raise _ended(episode)
            index = self._counts.get(episode, 0)
            self._counts[episode] = index + 1
            round_ = self._rounds.get(episode, 0)
        stamp = _stamp(request.headers)
        # only the template's text is read here, not the tokenizer (which the generation thread uses)
        chat = tool_calls.chat(messages, tools, self.tokenizer(agent), response_format)
        pending = _Pending(episode, index, agent, messages, chat, sampling, time.monotonic(),
                           asyncio.get_running_loop().create_future(), stop,
                           *(stamp if stamp is not None else (round_, index)), stamped=stamp is not None,
                           logprobs=want_logprobs)
        self._pending.append(pending)
        self._wake.set()
        call: Call = await pending.future
        request.state.answered = pending.answered
        message, finish = {"role": "assistant", "content": call.text}, "length" if call.truncated else "stop"
        if tools:  # the call keeps the reply's tokens as sampled: the learner trains on the calls as written
            content, calls = tool_calls.parse(call.text, {t["function"]["name"] for t in tools},
                                              self._call_ids(episode, index))
            if calls:
                message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        logprobs = None
        if want_logprobs:  # the behaviour log-probabilities of the sampled tokens (those the learner records)
            logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                                    for t, lp in zip(call.tokens or [], call.logprobs)], "refusal": None}
        response = {
            "id": f"chatcmpl-{episode}-{index}", "object": "chat.completion", "created": int(time.time()),
            "model": agent,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.response_ids),
                      "total_tokens": len(call.prompt_ids) + len(call.response_ids)},
        }
        return response if stream is None else _events(_chunks(response, **stream))

    def _call_ids(self, episode: str, index: int) -> Callable[[int], str]:
        """The ids of a reply's tool calls: 9 letters and digits (what Mistral's templates require),
        the same for the same episode and call in every run of a seed (the ids are in later messages,
        which order a batch); a served endpoint mixes in its key, so that two servers' ids differ."""
        salt = "" if self.fixed_sampling else self.api_key

        def make(k: int) -> str:
            n = int.from_bytes(hashlib.sha256(f"{salt}/{episode}/{index}/{k}".encode()).digest()[:8], "big")
            return "".join(_ALNUM[(n // 62 ** i) % 62] for i in range(9))
        return make

    def _sampling(self, agent: str, body: dict) -> Sampling:
        cap = self.team[agent].max_new_tokens or self.sampling.max_new_tokens
        s = replace(self.sampling, max_new_tokens=cap)
        # max_completion_tokens wins over max_tokens; null is "not given" (then the other, or the cap)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        wanted = body.get(key)
        if wanted is not None:
            if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
                raise _Refused(400, f"{key} must be a positive whole number, got {wanted!r}", param=key)
            s = replace(s, max_new_tokens=min(wanted, cap))
        for key, lo, hi, name in (("temperature", 0.0, 2.0, "temperature"), ("top_p", 0.0, 1.0, "top_p")):
            v = body.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or (key == "top_p" and v == 0):
                raise _Refused(400, f"{key} must be a number in {'(0, 1]' if key == 'top_p' else '[0, 2]'}, got {v!r}",
                               param=key)
            if self.fixed_sampling:
                if float(v) != getattr(s, name):  # once per process: every rollout has its own server
                    warn_once(f"warning: the workflow asks for {key}={v}; a run's episodes sample "
                              f"at the run's temperature and top_p (here {s.temperature} and {s.top_p}: "
                              "rollout.temperature in training, eval.temperature in evaluations), which training "
                              "assumes; a request's temperature and top_p are ignored in a run (marft serve honours "
                              "them). Said once per run.", key="fixed_sampling")
                continue
            s = replace(s, **{name: float(v)})
        return s

    # ---------------------------------------------------------------- the batching side
    async def _batcher(self) -> None:
        while True:
            # with ready, look again every wait_s (what it reads may change without a request: a client
            # that went idle); a request that waits longer than patience_s goes anyway
            timeout = None if not self._pending else self.wait_s if self.ready is not None else self.patience_s
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if not self._pending:
                continue
            if self.ready is not None:
                waited = time.monotonic() - min(p.started for p in self._pending)
                waiting: dict[str, int] = {}
                for p in self._pending:
                    waiting[p.episode] = waiting.get(p.episode, 0) + 1
                if not self.ready(waiting):
                    if waited < self.patience_s:
                        continue
                    self.impatient += 1
            else:  # wait until no new request has come for wait_s
                seen = -1
                while seen != len(self._pending):
                    seen = len(self._pending)
                    await asyncio.sleep(self.wait_s)
            batch, self._pending = self._pending, []
            with self._lock:  # this batch is each of its episodes' next round
                for episode in dict.fromkeys(p.episode for p in batch):
                    self._rounds[episode] = self._rounds.get(episode, 0) + 1
                for p in batch:
                    p.answered = self._rounds[p.episode]
            order = {a: i for i, a in enumerate(self.team.names)}
            groups: dict[tuple, list[_Pending]] = {}
            for p in sorted(batch, key=lambda p: (p.episode, p.round, order[p.agent], messages_key(p.messages), p.seq, p.index)):
                groups.setdefault((p.agent, astuple(p.sampling)), []).append(p)
            for (agent, _), group in groups.items():
                sampling = group[0].sampling
                try:
                    out = await self._in_generation_thread(self._generate, agent, sampling, group)
                except Exception as e:  # noqa: BLE001 - the requests fail, the endpoint goes on
                    for p in group:
                        p.future.set_exception(_Refused(500, f"generation failed: {type(e).__name__}: {e}",
                                                        kind="server_error"))
                    continue
                for p, call in zip(group, out):
                    with self._lock:
                        if p.episode in self._closed and not isinstance(call, _Refused):
                            call = _ended(p.episode)  # the episode ended while this was generated
                        if not isinstance(call, _Refused):
                            self._calls.setdefault(p.episode, []).append(call)
                    _settle(p.future, None if isinstance(call, _Refused) else call, call if isinstance(call, _Refused) else None)
            if self._pending:
                self._wake.set()

    def _refusal(self, agent: str, p: _Pending) -> _Refused | None:
        """A 400 for a chat that cannot be generated: one the agent's chat template rejects (roles out
        of the order it allows, more tool calls than it takes, ...), so that it fails alone, not its
        whole batch, or a prompt over the context; None for one that can."""
        tok = self.tokenizer(agent)
        try:
            text = render_chat(tok, p.chat)
        except Exception as e:  # noqa: BLE001 - jinja's own errors, and the template's raise_exception
            return _Refused(400, f"{agent}'s chat template cannot render these messages ({type(e).__name__}: "
                                 f"{str(e)[:300]})", param="messages")
        ids = tok(text, add_special_tokens=False)["input_ids"]  # as the engines encode it
        limit = self.context(agent)
        if len(ids) + p.sampling.max_new_tokens <= limit:
            return None
        return _Refused(400, f"This model's maximum context length is {limit} tokens; the messages take "
                             f"{len(ids)} and the reply up to {p.sampling.max_new_tokens}. Shorten the messages.",
                        param="messages", code="context_length_exceeded")

    def _generate(self, agent: str, sampling: Sampling, group: list[_Pending]) -> list[Call | _Refused]:
        """One batch, in the generation thread (the pump's or the worker's): the tokenizer is used
        only there, one call at a time (a fast tokenizer used from two threads at once fails), first
        to refuse chats that cannot be generated (:meth:`_refusal`)."""
        refused = {id(p): r for p in group if (r := self._refusal(agent, p)) is not None}
        ok = [p for p in group if id(p) not in refused]
        calls = {id(p): c for p, c in zip(ok, self._generated(agent, sampling, ok))} if ok else {}
        return [refused.get(id(p)) or calls[id(p)] for p in group]

    def _generated(self, agent: str, sampling: Sampling, group: list[_Pending]) -> list[Call]:
        t0 = time.perf_counter()
        out = self.engine.generate(agent, [p.chat for p in group], sampling, self.generator)
        self.gen_seconds += time.perf_counter() - t0
        self.gen_flops += self.engine.flops(agent, out)
        self.batches.append((agent, len(group)))
        done = time.monotonic()
        tok = self.tokenizer(agent) if any(p.logprobs for p in group) else None
        calls = []
        for row, p in enumerate(group):
            prompt = out.prompt_ids[row][out.prompt_mask[row]].tolist()
            mask = out.response_mask[row]
            calls.append(Call(p.episode, p.index, agent, p.messages, prompt, out.response_ids[row][mask].tolist(),
                              out.logprobs[row][mask].tolist(), bool(out.truncated[row]),
                              _before_stop(out.texts[row], p.stop), sampling, p.started, done - p.started,
                              p.round, p.seq, getattr(out, "version", None), p.stamped))
            if p.logprobs:  # each token's text, decoded here: the tokenizer is used in this thread only
                calls[-1].tokens = [tok.decode([i]) for i in calls[-1].response_ids]
        return calls


def _stamp(headers) -> tuple[int, int] | None:
    """A request's ``x-marft-round`` and ``x-marft-seq`` (module docstring), None unless both are whole numbers."""
    try:
        round_, seq = int(headers["x-marft-round"]), int(headers["x-marft-seq"])
    except (KeyError, ValueError):
        return None
    return (round_, seq) if round_ >= 0 and seq >= 0 else None


_IGNORED = ("logit_bias", "frequency_penalty", "presence_penalty", "seed")  # accepted, not applied (one warning)
_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _ended(episode: str) -> _Refused:
    return _Refused(400, f"episode {episode} has ended (its workflow returned, or ran past its time): a call made after "
                         "that is not part of it; wait for every call's reply before the workflow returns",
                    code="episode_ended")


def _logprobs(logprobs, top) -> bool:
    """A request's ``logprobs`` (true: the sampled tokens' log-probabilities) and ``top_logprobs``
    (only 0: the alternatives are not kept), or a 400."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _Refused(400, f"logprobs must be true or false, got {logprobs!r}", param="logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise _Refused(400, f"top_logprobs must be a whole number 0-20, got {top!r}", param="top_logprobs")
        if top > 0:
            raise _Refused(400, "top_logprobs is not supported: marft's endpoint returns the sampled tokens' "
                                "log-probabilities (logprobs: true), not the alternatives", param="top_logprobs")
        if not logprobs:
            raise _Refused(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return bool(logprobs)


def messages_key(messages: list[dict]) -> str:
    """Messages as a sort key (requests of one episode, round and agent: by what they ask, not by arrival)."""
    return json.dumps(messages, sort_keys=True, default=str)


def _bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host:port`` (every address ``host`` resolves to, as uvicorn's own
    binding does; with port 0 they share the first one's port), or a :class:`UserError` that says
    why not: no such host, not an address of this machine, the port taken or privileged."""
    where = f"{host}:{port}"
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise UserError(f"cannot serve on {where}: the port must be a whole number 0-65535 (0: any free port)")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"cannot serve on {where}: {host} is not a valid address of this machine "
                        f"({getattr(e, 'strerror', None) or e}); give --host an address of this machine, "
                        "e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(2048)
            sock.setblocking(False)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise UserError(_bind_error(host, port, e)) from None
    return sockets


def _bind_error(host: str, port: int, e: OSError) -> str:
    where, why = f"{host}:{port}", e.strerror or str(e)
    if e.errno == errno.EADDRINUSE:
        return f"cannot serve on {where}: the port is in use ({why}); choose another --port, or --port 0 for any free one"
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"cannot serve on {where}: {host} is not a valid address of this machine ({why}); give --host an "
                "address of this machine, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"cannot serve on {where}: not allowed ({why}; ports below 1024 need root); choose another --port"
    return f"cannot serve on {where} ({type(e).__name__}: {why}); check --host and --port"


def _settle(future, result, error) -> None:
    """Complete ``future`` (on the event loop's thread) unless it was cancelled meanwhile."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _messages(messages) -> list[dict]:
    """The chat as {role, content} text messages, or a 400 saying what is wrong. An assistant's tool
    calls are kept as transformers' chat templates take them (``tool_calls``, each function's
    arguments a dict; its content "" when none), a tool's result with its ``tool_call_id`` and, where
    known, the function's ``name``."""
    if not isinstance(messages, list) or not messages:
        raise _Refused(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    names: dict = {}  # tool call id -> its function's name, for the tool messages that answer it
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise _Refused(400, f"messages[{i}] must be an object with role system, user, assistant or tool",
                           param=f"messages[{i}].role")
        content = m.get("content")
        calls = _tool_calls(m.get("tool_calls"), i) if m["role"] == "assistant" else []
        if calls and content is None:  # a reply that only calls tools
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
                raise _Refused(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise _Refused(400, f"messages[{i}].content must be text", param=f"messages[{i}].content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        if calls:
            out[-1]["tool_calls"] = calls
            names.update((c["id"], c["function"]["name"]) for c in calls if "id" in c)
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise _Refused(400, f"messages[{i}].tool_call_id must be the id of the tool call it answers",
                               param=f"messages[{i}].tool_call_id")
            out[-1]["tool_call_id"] = m["tool_call_id"]
            name = m.get("name") or names.get(m["tool_call_id"])
            if isinstance(name, str):
                out[-1]["name"] = name
    return out


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` (null or absent: none), arguments parsed, or a 400."""
    if calls is None:
        return []
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _Refused(400, f"{where} must be a list of tool calls", param=where)
    out = []
    for k, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        args = f.get("arguments") if isinstance(f, dict) else None
        with contextlib.suppress(ValueError, RecursionError):
            args = json.loads(args) if isinstance(args, str) else args
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(args, dict)
                and c.get("type", "function") == "function"):
            raise _Refused(400, f"{where}[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"arguments\": <a JSON object, as a string>}}}}, got {c!r}", param=f"{where}[{k}]")
        out.append({"type": "function", "function": {"name": f["name"], "arguments": args}})
        if isinstance(c.get("id"), str):
            out[-1]["id"] = c["id"]
    return out


def _tools(tools, choice) -> list[dict] | None:
    """A request's ``tools`` as the model is to be shown them: None when there are none or
    ``tool_choice`` is "none"; a 400 for malformed ones, or a ``tool_choice`` that would force a call."""
    if choice is not None and choice not in ("auto", "none"):
        raise _Refused(400, f"tool_choice must be \"auto\" or \"none\": marft's endpoint does not force a tool call "
                            f"(\"required\" or a named function), got {choice!r}", param="tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _Refused(400, f"tools must be a list of functions, got {tools!r}", param="tools")
    out, seen = [], set()
    for k, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        ok = isinstance(f, dict) and t.get("type") == "function" and isinstance(f.get("name"), str) and f["name"]
        if not ok or not isinstance(f.get("description") or "", str) or not isinstance(f.get("parameters") or {}, dict):
            raise _Refused(400, f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"description\"?: <text>, \"parameters\"?: <a JSON schema object>}}}}, got {t!r}",
                           param="tools")
        if f["name"] in seen:
            raise _Refused(400, f"tools[{k}]: a second function named {f['name']!r}", param="tools")
        seen.add(f["name"])
        out.append({"type": "function", "function": {key: v for key, v in f.items() if v is not None}})
    return out if out and choice != "none" else None


def _response_format(fmt) -> dict | None:
    """A request's ``response_format``: None for text (or none), the json_object / json_schema format
    to ask for in the prompt (with one warning that it is not enforced), or a 400."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    schema = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if kind == "json_object" or (kind == "json_schema" and isinstance(schema, dict)
                                 and isinstance(schema.get("schema", {}), dict)):
        warn_once("warning: a request asks for response_format " + kind + ": marft shows it to the model as an "
                   "instruction (the schema in the system message) but does not constrain sampling to it")
        return fmt
    raise _Refused(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                        f"\"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}, got {fmt!r}",
                   param="response_format")


def _stop_strings(stop) -> tuple[str, ...]:
    """A request's ``stop``: a string or a list of up to 4 non-empty strings (OpenAI's limit), or a 400."""
    if stop is None:  # null: not given
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise _Refused(400, f"stop must be a non-empty string or a list of at most 4 non-empty strings, got {stop!r}",
                       param="stop")
    return tuple(stops)


def _stream(stream, options) -> dict | None:
    """A request's ``stream`` and ``stream_options``: None for a JSON reply, else the keywords of
    :func:`_chunks`; or a 400, as OpenAI's (``stream_options`` is only allowed with ``stream: true``).
    Other keys of ``stream_options`` (``include_obfuscation``) are ignored: the chunks are never padded."""
    if stream is not None and not isinstance(stream, bool):
        raise _Refused(400, f"stream must be true or false, got {stream!r}", param="stream")
    if options is None:  # null: not given
        return {"include_usage": False} if stream else None
    if not stream:
        raise _Refused(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       param="stream_options")
    usage = options.get("include_usage") if isinstance(options, dict) else None
    if not isinstance(options, dict) or (usage is not None and not isinstance(usage, bool)):
        raise _Refused(400, f"stream_options must be an object such as {{\"include_usage\": true}} (include_usage "
                            f"true or false), got {options!r}", param="stream_options")
    return {"include_usage": bool(usage)}


class _Events(list):
    """A streamed reply: its Server-Sent Events, ``data: ...`` lines, the last ``data: [DONE]``."""


def _events(chunks: list[dict]) -> _Events:
    return _Events([f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks] + ["data: [DONE]\n\n"])


def _chunks(response: dict, include_usage: bool = False) -> list[dict]:
    """A ``chat.completion`` ``response`` as the ``chat.completion.chunk`` objects OpenAI streams, all
    at once: the role with the whole content (and the log-probabilities, where asked), each tool call whole (its own chunk, with its
    ``index``; the first in the role's chunk, content null, when the reply is only tool calls), an
    empty delta with the finish reason, then, with ``include_usage``, ``choices: []`` with the usage
    (the other chunks then carry ``usage: null``, as OpenAI's)."""
    (choice,) = response["choices"]
    message = choice["message"]
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    tail = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **tail}

    calls = [{"index": k, **c} for k, c in enumerate(message.get("tool_calls", []))]
    first = {"role": "assistant", "content": message["content"]}
    if message["content"] is None and calls:
        first["tool_calls"], calls = calls[:1], calls[1:]
    out = ([chunk(first, logprobs=choice.get("logprobs"))] + [chunk({"tool_calls": [c]}) for c in calls]
           + [chunk({}, choice["finish_reason"])])
    if include_usage:
        out.append({**head, "choices": [], "usage": response["usage"]})
    return out


def _before_stop(text: str, stop: tuple[str, ...]) -> str:
    """A reply's text before the first of a request's stop strings, as OpenAI returns it (the engine
    ended the reply at the token that completed it: those tokens are what the learner trains on)."""
    return text[:min((i for x in stop if (i := text.find(x)) >= 0), default=len(text))]


def serve_team(models, team, engine, sampling: Sampling, **kw) -> TeamServer:
    """A :class:`TeamServer` for a :class:`marft.engines.models.TeamModel`'s team (tokenizers and context
    lengths from its base models)."""

    def tokenizer(agent: str):
        return models.for_agent(agent)[1]

    def context(agent: str) -> int:  # the model's positions, within an engine's own limit (vLLM's max_model_len)
        model = models.for_agent(agent)[0]
        return min(int(getattr(model.config, "max_position_embeddings", 0) or 2**31),
                   getattr(engine, "max_model_len", None) or 2**31)

    return TeamServer(team, engine, sampling, tokenizer, context, **kw)
