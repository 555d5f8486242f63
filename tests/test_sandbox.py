"""Hostile programs in the sandbox: each gets a bounded, correct result and leaves the machine as
it was (no stray processes, no temporary folders, no files outside, the test process alive)."""
import os
import socket
import tempfile
import time
import uuid

import pytest

from marft.envs.sandbox import Limits, Sandbox

ROOT = tempfile.mkdtemp(prefix="marft-sandbox-tests-")  # only this file's sandboxes live here
SB = Sandbox(Limits(wall_s=3, cpu_s=3, memory_mb=512, processes=16, output_bytes=100_000), workers=2, tmp_root=ROOT)
PROTECTIONS = " ".join(SB.protections())


def _sandbox_processes() -> list[int]:
    """Processes whose working directory is one of this file's sandbox folders."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/cwd").startswith(ROOT + os.sep):
                    found.append(int(pid))
            except OSError:
                pass
    return found


def _sandbox_dirs() -> list[str]:
    return os.listdir(ROOT)


@pytest.fixture
def clean_machine():
    before_dirs = set(_sandbox_dirs())
    yield
    for _ in range(50):  # killed processes may take a moment to be reaped
        if not _sandbox_processes():
            break
        time.sleep(0.05)
    assert _sandbox_processes() == [], "sandboxed processes were left running"
    assert set(_sandbox_dirs()) <= before_dirs, "a sandbox folder was left behind"


def run(src: str):
    t = time.monotonic()
    r = SB.run({"main.py": src}, ["main.py"])
    return r, time.monotonic() - t


def test_a_plain_program_runs(clean_machine):
    r, _ = run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("error", 3, "out\n", "err\n")
    r, _ = run("print(sum(range(10)))")
    assert r.ok and r.stdout == "45\n"


@pytest.mark.parametrize("src", ["while True: pass", "import time\ntime.sleep(60)"])
def test_infinite_loop_and_sleep_are_killed_at_the_time_limit(clean_machine, src):
    r, dt = run(src)
    assert r.status in ("timeout", "cpu_limit") and r.exit_code < 0
    assert dt < 3 + 5


def test_fork_bomb_is_contained(clean_machine):
    if "processes" not in PROTECTIONS:
        pytest.skip(f"no process limit on this machine ({PROTECTIONS})")
    src = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r, dt = run(src)
    assert r.status in ("timeout", "cpu_limit") and dt < 3 + 5


def test_fifty_gigabytes_get_a_memory_error(clean_machine):
    r, dt = run("x = bytearray(50 * 2**30)")
    assert r.status == "error" and "MemoryError" in r.stderr and dt < 3


def test_printing_a_gigabyte_is_cut_at_the_output_limit(clean_machine):
    r, dt = run("import sys\nc = 'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.write(c)\n")
    assert r.status == "output_limit" and len(r.stdout) <= 100_000 and dt < 3 + 2


def test_writing_outside_the_working_directory_fails(clean_machine):
    if "landlock: writes" not in PROTECTIONS:
        pytest.skip(f"Landlock is not available on this machine ({PROTECTIONS})")
    target = os.path.join(tempfile.gettempdir(), f"marft-escape-{uuid.uuid4().hex}")
    home = os.path.join(os.path.expanduser("~"), f"marft-escape-{uuid.uuid4().hex}")
    r, _ = run(f"open({target!r}, 'w').write('x')")
    assert r.status == "error" and "PermissionError" in r.stderr and not os.path.exists(target)
    r, _ = run(f"import os\nos.mkdir({home!r})")
    assert r.status == "error" and not os.path.exists(home)
    r, _ = run("open('inside.txt', 'w').write('x')\nprint(open('inside.txt').read())")  # its own folder is fine
    assert r.ok and r.stdout == "x\n"


def test_network_connections_fail(clean_machine):
    if "network namespace" not in PROTECTIONS and "TCP" not in PROTECTIONS:
        pytest.skip(f"no network isolation on this machine ({PROTECTIONS})")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    server.settimeout(0.5)
    r, _ = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert r.status == "error" and "connected" not in r.stdout
    with pytest.raises(socket.timeout):
        server.accept()  # nobody got through
    server.close()


@pytest.mark.parametrize("src", ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('sent')",
                                 "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
                                 "import os, signal\nos.kill(-1, signal.SIGKILL)"])
def test_killing_its_parent_harms_nobody(clean_machine, src):
    if "pid namespace" not in PROTECTIONS:
        pytest.skip(f"no PID namespace on this machine ({PROTECTIONS})")
    r, dt = run(src)
    assert r.status in ("ok", "error") and dt < 3
    assert SB.run({"m.py": "print(2 + 2)"}, ["m.py"]).stdout == "4\n"  # we are alive and the sandbox works


def test_os_exit_and_stdin(clean_machine):
    r, _ = run("import os\nprint('before', flush=True)\nos._exit(0)\nprint('after')")
    assert r.ok and r.stdout == "before\n"
    r, dt = run("import sys\nprint(repr(sys.stdin.read()))")  # stdin is empty: never blocks
    assert r.ok and r.stdout == "''\n" and dt < 3
    r, _ = run("input()")
    assert r.status == "error" and "EOFError" in r.stderr


def test_many_programs_in_parallel_keep_their_order(clean_machine):
    jobs = [({"p.py": f"print({i} * {i})"}, ["p.py"]) for i in range(12)]
    results = SB.run_many(jobs)
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(12)]


def test_a_peer_talks_to_the_program_on_its_own_channel(clean_machine):
    def peer(to_program, from_program):
        os.write(to_program, b"ping\n")
        got = b""
        while not got.endswith(b"\n"):
            chunk = os.read(from_program, 100)
            if not chunk:
                break
            got += chunk
        return got, os.read(from_program, 100)  # then end-of-file: the program is gone

    src = "import os\nline = os.read(3, 100)\nos.write(4, line.upper())\nprint('printed')"
    r = SB.run({"m.py": src}, ["m.py"], peer=peer)
    assert r.ok and r.stdout == "printed\n" and r.peer == (b"PING\n", b"")
    r = SB.run({"m.py": "import os\nos.write(3, b'x')"}, ["m.py"])  # without a peer there is no channel
    assert r.status == "error" and "Bad file descriptor" in r.stderr


def test_the_program_cannot_open_the_launchers_descriptors(clean_machine):
    if "launcher not dumpable" not in PROTECTIONS or "landlock" not in PROTECTIONS:
        pytest.skip(f"needs a non-dumpable launcher and Landlock ({PROTECTIONS})")
    src = """import os
opened = []
for pid in os.listdir('/proc'):
    if pid.isdigit() and pid != os.readlink('/proc/self'):  # its own pid as /proc (the host's) sees it
        for what in ('fd/0', 'fd/1', 'mem'):
            try:
                os.close(os.open(f'/proc/{pid}/{what}', os.O_WRONLY))
                opened.append(pid + '/' + what)
            except OSError:
                pass
print(opened)"""
    r, _ = run(src)
    assert r.ok and r.stdout == "[]\n", r.stdout  # nothing outside its own process, the launcher included


def test_missing_protections_are_named():
    from marft.envs.sandbox import missing_protections

    full = ["pids cgroup: at most 16 processes", "network namespace", "pid namespace",
            "landlock: writes only in the working directory"]
    assert missing_protections(full) == []
    assert missing_protections(full[:2]) == ["process isolation (PID namespace)",
                                             "write protection outside the working folder (Landlock)"]


def test_workers_bound_programs_at_once_across_threads(monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    sb = Sandbox(workers=2)
    running, peak, lock = [0], [0], threading.Lock()

    def fake_run(files, args, lim, peer=None):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    monkeypatch.setattr(sb, "_run", fake_run)
    with ThreadPoolExecutor(8) as pool:  # like the rollout stepping 8 episodes at once
        list(pool.map(lambda i: sb.run({}, []), range(16)))
    assert peak[0] == 2
