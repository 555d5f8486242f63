"""Run untrusted Python programs (the agents' code and its tests) with limits, many at a time.

Every program runs in a fresh temporary directory, in its own process group, started by a small
launcher (:mod:`marft._sandbox_boot`) that isolates itself before the program starts. What it
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
- **The trainer**: the program cannot see or signal it (PID namespace; Landlock signal scoping).

What it does **not** protect against: a kernel exploit; reading the user's files; using all CPU
cores for the length of the time limit; side channels. It is the isolation one wants for code that
a language model wrote by accident, not a security boundary against a determined attacker: for
that, run the trainer in a VM or container as well. On a machine without user namespaces or
Landlock (older kernels, some containers), the missing layers are simply absent and
``protections()`` says which remain.
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

    def run(self, files: dict[str, str], args: list[str], limits: Limits | None = None) -> Result:
        with self._slots:
            return self._run(files, args, limits or self.limits)

    def _run(self, files: dict[str, str], args: list[str], lim: Limits) -> Result:
        workdir = tempfile.mkdtemp(prefix="marft-sandbox-", dir=self.tmp_root)
        spec = {"workdir": workdir, "files": files, "args": list(args), "python": self.python, "limits": asdict(lim),
                "site_packages": self.site_packages}
        proc = subprocess.Popen([self.python, "-I", "-S", BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        start = time.monotonic()
        try:
            out, err = proc.communicate(json.dumps(spec).encode(), timeout=lim.wall_s + 15)
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
                          time.monotonic() - start)
        return Result(r["status"], r["exit_code"], r["stdout"], r["stderr"], r["wall_s"], r["protections"])

    def run_many(self, jobs: list[tuple[dict[str, str], list[str]]]) -> list[Result]:
        if len(jobs) <= 1 or self.workers == 1:
            return [self.run(f, a) for f, a in jobs]
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(lambda job: self.run(*job), jobs))

    def protections(self) -> list[str]:
        """The protections active on this machine (probed once per interpreter)."""
        return list(_probe(self.python))


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
