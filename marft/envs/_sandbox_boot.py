"""The sandbox's launcher: isolates itself, starts one program, watches it, reports as JSON.

Run by :mod:`marft.envs.sandbox` as ``python -I -S _sandbox_boot.py`` with a JSON spec on stdin; it
uses the standard library only and writes one JSON object to its stdout. It is trusted code: the
program under test never runs in this process. Steps:

1. (root only) join a fresh ``pids`` cgroup whose ``pids.max`` caps the number of processes;
2. unshare user, mount, network, PID, IPC and UTS namespaces (each that the kernel allows);
3. mount a size-limited tmpfs on the working directory and write the program's files into it;
4. restrict itself with Landlock: writes only inside the working directory (and /dev/null), no TCP
   bind or connect, no signals to processes outside the sandbox;
5. fork: the child (PID 1 of the new PID namespace, so every process it starts dies with it) sets
   resource limits and executes the program with stdout and stderr on pipes (and, when the caller
   asked for a channel, the two pipe ends it passed in on file descriptors 3 and 4);
6. read both pipes up to the output limit and wait up to the wall-clock limit; on either, kill the
   child with SIGKILL, which tears down the whole PID namespace.
"""
import ctypes
import fcntl
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 38, 1, 4
SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT = 444, 445, 446

libc = ctypes.CDLL(None, use_errno=True)


def _errno() -> str:
    return os.strerror(ctypes.get_errno())


def join_pids_cgroup(limit: int) -> str | None:
    """As root: a new pids cgroup capped at ``limit`` processes, joined. Returns its path."""
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        path = os.path.join(base, f"marft-sandbox-{os.getpid()}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(limit))
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            return path
        except OSError:
            try:
                os.rmdir(path)
            except OSError:
                pass
    return None


def enter_namespaces() -> list[str]:
    uid, gid = os.geteuid(), os.getegid()
    base = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    for flags in (base | CLONE_NEWUSER, base, CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID):
        if libc.unshare(flags) == 0:
            break
    else:
        return []
    if flags & CLONE_NEWUSER:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError:
                pass
    names = {CLONE_NEWUSER: "user", CLONE_NEWNS: "mount", CLONE_NEWNET: "network", CLONE_NEWPID: "pid",
             CLONE_NEWIPC: "ipc", CLONE_NEWUTS: "uts"}
    return [f"{v} namespace" for k, v in names.items() if flags & k]


def mount_tmpfs(path: str, size_mb: int) -> bool:
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    opts = f"size={size_mb}m,mode=0700".encode()
    return libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0


def landlock(workdir: str) -> list[str]:
    abi = libc.syscall(SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return []
    write = (1 << 1) | sum(1 << b for b in range(4, 13))  # WRITE_FILE, REMOVE_*, MAKE_*
    if abi >= 2:
        write |= 1 << 13  # REFER
    if abi >= 3:
        write |= 1 << 14  # TRUNCATE
    fields = [write]
    done = ["landlock: writes only in the working directory"]
    if abi >= 4:
        fields.append(0b11)  # TCP bind and connect: no rule allows them
        done.append("landlock: no TCP bind or connect")
    if abi >= 6:
        fields += [0] * (2 - len(fields)) + [0b11]  # scoped: abstract unix sockets, signals
        done.append("landlock: no signals or abstract sockets outside the sandbox")
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    fd = libc.syscall(SYS_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if fd < 0:
        return []

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    file_rights = (1 << 1) | ((1 << 14) if abi >= 3 else 0)
    for path, rights in ((workdir, write), ("/dev/null", file_rights)):
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(rights, pfd)
        ok = libc.syscall(SYS_LANDLOCK_ADD_RULE, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) == 0
        os.close(pfd)
        if not ok:
            os.close(fd)
            return []
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(SYS_LANDLOCK_RESTRICT, fd, ctypes.c_uint32(0)) != 0:
        os.close(fd)
        return []
    os.close(fd)
    return done


def child(spec: dict, out_w: int, err_w: int, use_rlimit_nproc: bool) -> None:
    """In the forked child: limits, pipes, exec. Never returns."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.setpgid(0, 0)
        channel = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in spec.get("channel", ())]  # clear of 0-4
        lim = spec["limits"]
        mem = lim["memory_mb"] * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_mb"] * 2**20,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if use_rlimit_nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for target, fd in zip((3, 4), channel):  # the peer's channel: requests in on 3, replies out on 4
            os.dup2(fd, target)
        os.closerange(3 + len(channel), 65536)
        os.chdir(spec["workdir"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": spec["workdir"], "TMPDIR": spec["workdir"],
               "LANG": "C.UTF-8"}
        flags = ["-I"] if spec.get("site_packages") else ["-I", "-S"]
        os.execve(spec["python"], [spec["python"], *flags, *spec["args"]], env)
    except BaseException as e:  # noqa: BLE001 - report anything and die
        os.write(2, f"sandbox: could not start the program: {e}\n".encode())
    os._exit(127)


def main() -> None:
    spec = json.loads(sys.stdin.read())
    lim = spec["limits"]
    report = os.dup(1)
    protections = []
    cgroup = join_pids_cgroup(lim["processes"] + 1) if os.geteuid() == 0 else None
    if cgroup:
        protections.append(f"pids cgroup: at most {lim['processes']} processes")
    protections += enter_namespaces()
    # Not dumpable: the program (which shares this process's user namespace and Landlock domain)
    # cannot open /proc/<launcher>/fd/* or mem, so it cannot write this launcher's report.
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0:
        protections.append("launcher not dumpable")
    workdir = spec["workdir"]
    if "mount namespace" in protections and mount_tmpfs(workdir, lim["disk_mb"]):
        protections.append(f"private tmpfs working directory of {lim['disk_mb']} MiB")
    for name, text in spec["files"].items():
        path = os.path.join(workdir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    protections += landlock(workdir)
    use_nproc = os.geteuid() != 0 or "user namespace" in protections and not cgroup
    if use_nproc and not cgroup:
        protections.append(f"RLIMIT_NPROC: at most {lim['processes']} processes")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(spec, out_w, err_w, use_nproc)
    os.close(out_w)
    os.close(err_w)
    for fd in spec.get("channel", ()):  # the program holds them now; the peer sees EOF when it ends
        os.close(fd)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    cap = lim["output_bytes"]
    status, open_fds, code, deadline = None, [out_r, err_r], None, start + lim["wall_s"]
    while True:
        left = deadline - time.monotonic()
        if status is None and left <= 0:
            status = "timeout"
        if status is not None:
            os.kill(pid, signal.SIGKILL)
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            code = st
            break
        ready = select.select(open_fds, [], [], max(0.0, min(left, 0.05)))[0] if open_fds else time.sleep(0.01) or []
        for fd in ready:
            data = os.read(fd, 65536)
            if not data:
                open_fds.remove(fd)
                continue
            bufs[fd] += data
            if len(bufs[fd]) > cap and status is None:
                status = "output_limit"
    wall = time.monotonic() - start
    for fd in open_fds:  # whatever is already buffered (the program is gone)
        while select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 65536)
            if not data or len(bufs[fd]) > cap:
                break
            bufs[fd] += data
    if "pid namespace" not in protections:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    exit_code = os.waitstatus_to_exitcode(code)
    if status is None:
        if exit_code == 0:
            status = "ok"
        elif exit_code == -signal.SIGXCPU or exit_code == -signal.SIGKILL and lim["cpu_s"] <= wall:
            status = "cpu_limit"
        else:
            status = "error"
    result = {"status": status, "exit_code": exit_code, "wall_s": wall,
              "stdout": bytes(bufs[out_r][:cap]).decode("utf-8", "replace"),
              "stderr": bytes(bufs[err_r][:cap]).decode("utf-8", "replace"),
              "protections": protections, "cgroup": cgroup}
    data = json.dumps(result).encode()
    while data:
        data = data[os.write(report, data):]


if __name__ == "__main__":
    main()
