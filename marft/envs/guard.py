"""Calls into user code that may raise or hang (an environment's ``reset`` and ``step``, a
workflow's reward function), each in a worker thread of its own, so that a failure or a hang is
confined to its episode: :func:`guarded` returns each call's error text (None where it returned). A
call that runs past its time is abandoned and :class:`EpisodeTimeout` is raised inside it (Python
code stops at its next bytecode; a call blocked inside C code, such as a socket read, stops when that
returns). May import: nothing of marft's."""
from __future__ import annotations

import ctypes
import threading
import time


class EpisodeTimeout(BaseException):
    """Raised inside an environment call that ran past ``env_timeout_s`` (a BaseException, so that
    an environment's own ``except Exception`` does not swallow it)."""


def _raise_in(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(EpisodeTimeout))


def describe(e: BaseException, timeout: float) -> str:
    """An error's text as :func:`guarded` gives it (a timeout names ``timeout``)."""
    if isinstance(e, EpisodeTimeout):
        return f"timed out after {timeout:g} s (rollout.env_timeout_s)"
    return f"{type(e).__name__}: {e}"[:300]


def _call_threads(fns: list, timeout: float) -> list[str | None]:
    """Each ``fn()`` in its own daemon thread, all at once; waits at most ``timeout`` for each."""
    errors: list[str | None] = ["did not finish"] * len(fns)

    def work(i, fn):
        try:
            fn()
            errors[i] = None
        except BaseException as e:  # noqa: BLE001 (EpisodeTimeout included)
            errors[i] = describe(e, timeout)

    threads = [threading.Thread(target=work, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    deadline = time.monotonic() + timeout
    for t in threads:
        t.start()
    result: list[str | None] = []
    for i, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            _raise_in(t.ident)  # abandoned: stop it where Python code allows
            result.append(describe(EpisodeTimeout(), timeout))
        else:
            result.append(errors[i])
    return result


def guarded(fns: list, concurrent: bool, timeout: float) -> list[str | None]:
    """Run ``fn()`` for each of ``fns``, each failure confined to itself: None where it returned,
    else the error's text (one that ran past ``timeout`` seconds: "timed out after ..."); all at once
    with ``concurrent``, else one at a time."""
    if concurrent:
        return _call_threads(fns, timeout)
    return [_call_threads([fn], timeout)[0] for fn in fns]
