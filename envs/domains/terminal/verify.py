"""The verifier of domain `terminal`: `env.TerminalEnvironment` runs it as verify.py in a fresh sandbox that
holds only data: the agent's final files under work/ (regular files, copied by the trusted host) and
exec.json (the repaired program's run on hidden inputs). The task's checks, with the expected values, come
on stdin, so they are never on disk where another sandboxed process could read them. Prints one JSON
verdict. Standard library only.
"""

import json
import os
import sys


def read(path):
    full = os.path.join("work", path)
    if not os.path.isfile(full):
        return None
    with open(full, "rb") as f:
        return f.read(1 << 20).decode("utf-8", "replace")


def norm(text):
    return "\n".join(line.rstrip() for line in text.strip("\n").split("\n"))


def check(c):
    if c["kind"] == "file":
        got = read(c["path"])
        if got is None:
            return c["path"] + " is missing"
        return None if norm(got) == norm(c["expected"]) else c["path"] + " has the wrong content"
    if c["kind"] == "tree":
        root = os.path.join("work", c["dir"])
        names = sorted(os.listdir(root)) if os.path.isdir(root) else []
        if names != sorted(c["expected"]):
            return c["dir"] + " does not hold the expected file names"
        same = all(read(os.path.join(c["dir"], n)) == text for n, text in c["expected"].items())
        return None if same else "a file in " + c["dir"] + " changed its contents"
    with open("exec.json") as f:
        run = json.load(f)
    if run["timed_out"]:
        return "the repaired program timed out on the hidden input"
    if run["returncode"] != 0:
        return f"the repaired program exited with {run['returncode']} on the hidden input"
    return None if norm(run["stdout"]) == norm(c["expected"]) else "wrong output on the hidden input"


if __name__ == "__main__":
    reasons = [r for r in map(check, json.load(sys.stdin)) if r]
    print(json.dumps({"ok": not reasons, "reasons": reasons}))
