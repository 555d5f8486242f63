"""Run untrusted Python programs (the agents' code and its tests) with limits, many at a time.

Every program runs in a fresh temporary directory, in its own process group, started by a small
launcher (:mod:`marft.envs._sandbox_boot`) that isolates itself before the program starts. What it
protects against, where the kernel allows (``Sandbox().protections()`` lists what is active on
this machine; code tasks print a warning naming any layer that is missing):

- **Runaway time**: a wall-clock limit (the launcher kills the program) and a CPU-time limit
  (RLIMIT_CPU).
- **Runaway memory**: an address-space limit per process (RLIMIT_AS); a program that allocates
  50 GB gets a ``MemoryError``.
- **Fork bombs**: a process limit (a ``pids`` cgroup when running as root, RLIMIT_NPROC in a user
  namespace otherwise).
- **Runaway output**: stdout and stderr are read up to ``output_bytes`` each, then the program is
  killed; files are limited to ``file_mb`` each (RLIMIT_FSIZE) and, with a mount namespace, to a
  ``disk_mb`` tmpfs in all.
- **Stray processes**: the program is PID 1 of a new PID namespace, so when it ends or is killed
  every process it started is killed by the kernel; without a PID namespace its process group is
  killed, and a child that calls ``setsid()`` can escape (say so: ``protections()``).
- **The network**: a new network namespace has no interface but a loopback that is down, so
  connections fail; with Landlock ABI >= 4, TCP bind and connect are refused as well.
- **The file system**: Landlock allows writes only inside the working directory (and /dev/null);
  reading is *not* restricted (a program can read any file the user can, and print it).
- **The trainer**: the program cannot see or signal it (PID namespace; Landlock signal scoping),
  nor read or write its memory or file descriptors (Landlock lets a confined process ptrace, or
  open ``/proc/<pid>/mem`` and ``/proc/<pid>/fd`` of, only processes in its own domain; the
  launcher, which shares that domain, makes itself non-dumpable). The same holds for any peer
  process the caller starts outside the sandbox (below).

**A private channel.** ``run(..., peer=fn)`` gives the program a pair of pipes, file descriptors
3 (it reads) and 4 (it writes), and calls ``fn`` with the other ends in the caller's thread while
the program runs. The code tasks use it to keep the grading verdict out of the program's reach: the
tests run in a checker process outside the sandbox and ask the program only for values
(:mod:`marft.envs._code_checker`). Nothing else the program says (stdout, stderr, its exit
status) decides anything there.

What it does **not** protect against: a kernel exploit; reading the user's files; using all CPU
cores for the length of the time limit; side channels (timing, the load of the machine). It is
the isolation one wants for code that a language model wrote, including code that tries to cheat
its grader; it is not a boundary against an attacker with a kernel exploit: for that, run the
trainer in a VM or container as well. On a
machine without user namespaces or Landlock (older kernels, some containers), the missing layers
are simply absent and ``protections()`` says which remain; without Landlock, a program running as
the trainer's user may be able to reach processes outside the sandbox through ``/proc``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_boot.py")


@dataclass
class Limits:
    """Resource limits for one program run."""

    wall_s: float = 10.0  # wall-clock seconds before the program is killed
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process
    processes: int = 16  # processes and threads at once
    open_files: int = 64  # file descriptors per process
    output_bytes: int = 1_000_000  # stdout and stderr, each
    file_mb: int = 16  # size of any one file written
    disk_mb: int = 64  # the working directory in all (tmpfs; needs a mount namespace)


@dataclass
class Result:
    """What happened to one program."""

    status: str  # ok | error | timeout | cpu_limit | output_limit | sandbox_error
    exit_code: int | None = None  # negative: killed by that signal
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    protections: list[str] = field(default_factory=list)
    peer: object = None  # what the run's peer function returned (see Sandbox.run)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox:
    """Runs programs under :class:`Limits`, up to ``workers`` at a time.

    ``run({"main.py": source}, ["main.py"])`` writes the files into a fresh directory and runs
    ``python -I -S main.py`` there (the standard library only; ``site_packages=True`` adds the
    interpreter's installed packages, at about 35 ms more per program); ``run_many`` runs a list of such jobs in parallel threads (each
    program is its own process) and returns the results in order. At most ``workers`` programs
    run at once across all threads that share this sandbox.
    """

    def __init__(self, limits: Limits | None = None, workers: int = 4, python: str | None = None,
                 site_packages: bool = False, tmp_root: str | None = None):
        self.limits = limits or Limits()
        self.tmp_root = tmp_root  # where the working folders go (default: the system's temporary folder)
        self.site_packages = site_packages
        self.workers = max(1, int(workers))
        self._slots = threading.BoundedSemaphore(self.workers)  # programs at once, across all callers
        self.python = python or sys.executable

    def run(self, files: dict[str, str], args: list[str], limits: Limits | None = None, peer=None) -> Result:
        """Run one program. With ``peer``, the program also gets a private channel: it reads file
        descriptor 3 and writes 4, and ``peer(to_program, from_program)`` is called in this thread
        with the other ends while the program runs; what it returns is ``Result.peer``."""
        with self._slots:
            return self._run(files, args, limits or self.limits, peer)

    def _run(self, files: dict[str, str], args: list[str], lim: Limits, peer=None) -> Result:
        workdir = tempfile.mkdtemp(prefix="marft-sandbox-", dir=self.tmp_root)
        spec = {"workdir": workdir, "files": files, "args": list(args), "python": self.python, "limits": asdict(lim),
                "site_packages": self.site_packages}
        channel = (*os.pipe(), *os.pipe()) if peer else ()  # requests (read, write), replies (read, write)
        if peer:
            spec["channel"] = [channel[0], channel[3]]
        try:
            proc = subprocess.Popen([self.python, "-I", "-S", BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                                    pass_fds=(channel[0], channel[3]) if peer else ())
        except BaseException:
            for fd in channel:
                os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        start = time.monotonic()
        answer = None
        try:
            data = json.dumps(spec).encode()
            if peer:
                answer, data = _converse(proc, data, peer, channel), None
            out, err = proc.communicate(data, timeout=lim.wall_s + 15)
        except subprocess.TimeoutExpired:  # the launcher itself hung: kill it; its child dies with it
            proc.kill()
            proc.communicate()
            out, err = b"", b"the sandbox launcher did not finish in time"
        finally:
            _cleanup(workdir, proc.pid)
        try:
            r = json.loads(out)
        except ValueError:
            return Result("sandbox_error", proc.returncode, "", err.decode("utf-8", "replace")[-2000:],
                          time.monotonic() - start, peer=answer)
        return Result(r["status"], r["exit_code"], r["stdout"], r["stderr"], r["wall_s"], r["protections"], answer)

    def run_many(self, jobs: list[tuple]) -> list[Result]:
        """Each job is ``(files, args)`` or ``(files, args, peer)``; the results in order."""
        if len(jobs) <= 1 or self.workers == 1:
            return [self.run(*job) if len(job) == 2 else self.run(job[0], job[1], None, job[2]) for job in jobs]
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(lambda job: self.run(job[0], job[1], None, *job[2:]), jobs))

    def protections(self) -> list[str]:
        """The protections active on this machine (probed once per interpreter)."""
        return list(_probe(self.python))


def _converse(proc: subprocess.Popen, spec: bytes, peer, channel: tuple) -> object:
    """Give the launcher its spec, then let the peer talk to the program; the peer's answer."""
    os.close(channel[0])  # only the launcher (and then the program) hold these ends now, so the
    os.close(channel[3])  # peer reads end-of-file as soon as the program is gone
    try:
        proc.stdin.write(spec)
        proc.stdin.close()
    except OSError:  # the launcher died at once; its stderr says why
        pass
    proc.stdin = None  # communicate() afterwards only reads
    try:
        return peer(channel[1], channel[2])
    except BaseException:  # the peer failed, or we are interrupted: stop the program too
        proc.kill()
        proc.communicate()
        raise
    finally:
        os.close(channel[1])
        os.close(channel[2])


def missing_protections(protections: list[str]) -> list[str]:
    """The layers this module relies on that are absent from ``protections``, in words."""
    wanted = {"pid namespace": "process isolation (PID namespace)", "network namespace": "network isolation",
              "landlock: writes": "write protection outside the working folder (Landlock)",
              "processes": "a process limit"}
    text = " ".join(protections)
    return [words for key, words in wanted.items() if key not in text]


@lru_cache(maxsize=None)
def _probe(python: str) -> tuple[str, ...]:
    return tuple(Sandbox(Limits(wall_s=10), 1, python).run({"p.py": "pass"}, ["p.py"]).protections)


def _cleanup(workdir: str, boot_pid: int) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        path = os.path.join(base, f"marft-sandbox-{boot_pid}")
        for _ in range(50):  # processes of the dead namespace may take a moment to go
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)
