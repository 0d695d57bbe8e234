"""The hidden tests' runner of domain `code`: `env.CodeEnvironment` copies this file into the sandbox, which
runs it as `python3 -I -S -B runner.py TIMEOUT_S MAX_TIMEOUTS MAX_MESSAGE` (the python3 on the sandbox's
PATH: the sandboxed uid may not be able to run the host's interpreter). Standard library only.

It forks one worker per test (a fresh process, so state cannot leak between tests and an infinite loop costs
only its own test), reads each worker's output as JSON over a pipe and prints them all. It never sees
expected outputs; whatever it (or a solution that subverts it) prints is compared outside. Inside each
worker an audit hook refuses network, subprocesses, signals, ctypes, and file access outside the work dir
(reads: also the Python installation), and reports the attempt. Control lines from a worker: "I"
(imported), "M" (function missing), "X<type>" (import raised), "E<type>" (the call raised), "V<what>"
(forbidden operation), "R<json>" (the result).
"""

import json
import os
import select
import signal
import sys
import time

WORKDIR = os.path.realpath(os.getcwd())
READABLE = tuple({os.path.realpath(p) for p in (WORKDIR, sys.prefix, sys.base_prefix, sys.exec_prefix)})
BLOCKED = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "signal.pthread_kill",
    "ctypes.",
    "resource.setrlimit",
    "resource.prlimit",
    "pty.",
    "os.setuid",
    "os.chroot",
)
PATH_ARGS = {
    "os.remove": (0,),
    "os.rename": (0, 1),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.symlink": (1,),
    "os.link": (1,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "shutil.rmtree": (0,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
TIMEOUT_S, MAX_TIMEOUTS, MAX_MESSAGE = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def _under(path, roots):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)


def _worker(source, name, args, wfd):
    write, exit_ = os.write, os._exit

    def send(tag, text=""):
        write(wfd, (tag + text.replace("\n", " ")[:MAX_MESSAGE] + "\n").encode("utf-8", "replace"))

    def hook(event, hook_args):
        what = None
        if event == "open":
            writing = isinstance(hook_args[2], int) and hook_args[2] & WRITE_FLAGS
            if not _under(hook_args[0], (WORKDIR,) if writing else READABLE):
                what = ("write " if writing else "read ") + os.fsdecode(hook_args[0])
        elif event.startswith(BLOCKED):
            what = event
        elif event in PATH_ARGS and not all(_under(hook_args[i], (WORKDIR,)) for i in PATH_ARGS[event]):
            what = event + " outside the work dir"
        if what is not None:
            send("V", what)
            raise PermissionError("forbidden in the sandbox: " + what)

    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    sys.addaudithook(hook)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as e:
        send("X", type(e).__name__)
        exit_(0)
    fn = namespace.get(name)
    if not callable(fn):
        send("M")
        exit_(0)
    send("I")
    try:
        text = json.dumps(fn(*args))
    except BaseException as e:
        send("E", type(e).__name__)
        exit_(0)
    if not isinstance(text, str) or len(text) > MAX_MESSAGE:
        send("E", "OutputTooLarge" if isinstance(text, str) else "NotJSON")
        exit_(0)
    send("R", text)
    exit_(0)


def _collect(rfd, pid):
    buf, deadline, status = b"", time.monotonic() + TIMEOUT_S, None
    while status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status = "timeout"
        elif select.select([rfd], [], [], remaining)[0]:
            chunk = os.read(rfd, 1 << 16)
            buf += chunk
            status = "eof" if not chunk else "too_large" if len(buf) > 4 * MAX_MESSAGE else None
    try:  # noqa: SIM105 - the runner imports as little as it can
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    return buf.decode("utf-8", "replace"), status


def _run_one(source, name, args):
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            _worker(source, name, args, wfd)
        finally:
            os._exit(0)
    os.close(wfd)
    text, status = _collect(rfd, pid)
    os.close(rfd)
    lines = [line for line in text.split("\n") if line]
    report = {"violations": [line[1:] for line in lines if line[0] == "V"][:3], "imported": "I" in lines}
    for line in lines:
        if line[0] in "MXER" and "status" not in report:
            report["status"] = {"M": "missing", "X": "import_error", "E": "error", "R": "result"}[line[0]]
            report["detail"] = line[1:]
    if status in ("timeout", "too_large"):
        report["status"] = status
    report.setdefault("status", "no_result")
    return report


def main():
    with open("inputs.json") as f:
        spec = json.load(f)
    with open("solution.py") as f:
        source = f.read()
    tests, timeouts = [], 0
    for args in spec["inputs"]:
        if timeouts >= MAX_TIMEOUTS:
            tests.append({"status": "skipped", "violations": []})
            continue
        report = _run_one(source, spec["function"], args)
        timeouts += report["status"] == "timeout"
        tests.append(report)
        if report["status"] in ("missing", "import_error") or (
            report["status"] == "timeout" and not report["imported"]
        ):
            stop = dict(report, violations=[])
            tests += [stop] * (len(spec["inputs"]) - len(tests))
            break
    sys.stdout.write("\n" + json.dumps({"tests": tests}) + "\n")


if __name__ == "__main__":
    main()
