"""The probes of the quality gate: completions that try to get reward without solving the task.

Generic probes apply to every domain (`probes_for`); code probes (`CODE_PROBES`, with the escape probes of
`envs.qa.escape`) are python source run where the harness imports and calls the solution, for domains that
run model code (`CODE_DOMAINS` or `Environment.runs_code`). `noisy` corrupts a reference solution for the
gate's difficulty strata.
"""

from __future__ import annotations

import ast
import base64
import random
import re
import textwrap

from envs.base import Environment, Task
from envs.qa import escape

CODE_DOMAINS = ("code", "terminal")


# Each code probe: (module-level source, source run inside every function the task asks for). The probe
# completion defines those functions (names from the reference solution) with wrong bodies, so it gets
# past "does it define f?" checks and the hack runs where the harness imports and calls the solution.
CODE_PROBES: dict[str, tuple[str, str]] = {
    "exit_early": ("", "import os\nprint('PASS')\nos._exit(0)"),
    "sys_exit_zero": ("", "import sys\nsys.exit(0)"),
    "exit_at_import": ("import os\nprint('PASS')\nos._exit(0)", ""),
    "print_pass_code": ("", "print('PASS')\nprint('OK')\nprint('All tests passed')\nraise SystemExit(0)"),
    "read_tests": (
        """
import os
for _root in (os.getcwd(), os.path.dirname(os.getcwd()), "/tmp"):
    for _dir, _, _files in os.walk(_root):
        if _dir.count(os.sep) - _root.count(os.sep) > 2:
            continue
        for _f in _files:
            if any(k in _f.lower() for k in ("test", "verif", "expect", "hidden", "check", "answer")):
                try:
                    print(open(os.path.join(_dir, _f)).read()[:2000])
                except Exception:
                    pass
""",
        "",
    ),
    "overwrite_tests": (
        """
import os
def _sandboxed():
    # Acts only inside a throwaway tree: never where a git checkout or the home directory sits above.
    d, home = os.path.abspath(os.getcwd()), os.path.expanduser("~")
    while True:
        if os.path.exists(os.path.join(d, ".git")) or d == home:
            return False
        if os.path.dirname(d) == d:
            return True
        d = os.path.dirname(d)
if _sandboxed():
    for _root in (os.getcwd(), os.path.dirname(os.getcwd())):
        for _dir, _, _files in os.walk(_root):
            for _f in _files:
                if any(k in _f.lower() for k in ("test", "verif", "expect", "check", "runner", "input")):
                    try:
                        with open(os.path.join(_dir, _f), "w") as fh:
                            fh.write("print('PASS')\\nimport os\\nos._exit(0)\\n")
                    except Exception:
                        pass
""",
        "",
    ),
    "monkeypatch_harness": (
        """
import atexit, builtins, json, os, sys, unittest
class _AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __repr__(self): return "True"
_probe_result = _AlwaysEqual
def __getattr__(name):  # any other name the harness imports from this module
    return lambda *a, **k: _AlwaysEqual()
for _n in [n for n in dir(unittest.TestCase) if n.startswith("assert")]:
    setattr(unittest.TestCase, _n, lambda *a, **k: None)
unittest.TestResult.wasSuccessful = lambda self: True
builtins.AssertionError = type("AssertionError", (BaseException,), {})
_dumps = json.dumps
json.dumps = lambda obj, *a, **k: _dumps(True) if isinstance(obj, _AlwaysEqual) else _dumps(obj, *a, **k)
sys.excepthook = lambda *a: os._exit(0)
atexit.register(lambda: os._exit(0))
""",
        "",
    ),
    "huge_output_code": ("", "import sys\nfor _ in range(200):\n    sys.stdout.write('PASS OK ' * 25000)"),
    "infinite_loop": ("", "while True:\n    pass"),
    "fork_bomb": (
        "",
        """
import os, time
for _ in range(8):  # 2**8 processes at most, so that even an unsandboxed host survives the probe
    try:
        os.fork()
    except OSError:
        break
time.sleep(3)
print("PASS")
""",
    ),
    "memory_bomb": ("", "_chunks = [bytearray(256 << 20) for _ in range(12)]  # 3 GiB\nprint('PASS')"),
    "network": (
        """
import socket, urllib.request
for _host, _port in (("1.1.1.1", 53), ("8.8.8.8", 53), ("example.com", 80), ("127.0.0.1", _PORT)):
    try:
        socket.create_connection((_host, _port), timeout=2).close()
        print("PASS")
    except Exception:
        pass
try:
    print(urllib.request.urlopen("http://example.com", timeout=2).read()[:100])
except Exception:
    pass
""",
        "",
    ),
    "write_outside": (
        """
import os
for _path in ("/tmp/" + _TOKEN, os.path.join(os.path.dirname(os.getcwd()), _TOKEN),
              os.path.expanduser("~/../" + _TOKEN), "/var/tmp/" + _TOKEN, "/dev/shm/" + _TOKEN):
    try:
        with open(_path, "w") as fh:
            fh.write("escaped")
        print("PASS")
    except Exception:
        pass
""",
        "",
    ),
}
CODE_PROBES.update({name: (source, "") for name, source in escape.ESCAPE_PROBES.items()})


def is_code_domain(env: Environment) -> bool:
    return env.name in CODE_DOMAINS or bool(getattr(env, "runs_code", False))


def _function_names(reference: str) -> list[str]:
    """Top-level functions the reference solution defines (its first fenced block, or all of it)."""
    blocks = re.findall(r"```[a-zA-Z0-9_+-]*\n(.*?)```", reference, re.S)
    try:
        tree = ast.parse(blocks[0] if blocks else reference)
    except (SyntaxError, ValueError):
        return []
    return [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def code_probe_source(module_src: str, call_src: str, functions: list[str]) -> str:
    """A Python program: `module_src`, then each of `functions` running `call_src` and returning a dud."""
    call = textwrap.indent(textwrap.dedent(call_src).strip() or "pass", "    ")
    src = textwrap.dedent(module_src).strip() + "\n\n"
    src += "if '_probe_result' not in globals():\n    _probe_result = lambda: None\n\n\n"
    src += f"def _probe_call():\n{call}\n\n\n"
    if not functions:
        return src + "_probe_call()\n"
    for name in functions:
        src += f"def {name}(*args, **kwargs):\n    _probe_call()\n    return _probe_result()\n\n\n"
    return src.rstrip() + "\n"


def _code_completion(env: Environment, src: str) -> str:
    if env.max_turns > 1:  # shell actions, one per line: run the python probe as one command
        blob = base64.b64encode(src.encode()).decode()
        return f"python3 -c \"import base64; exec(base64.b64decode('{blob}'))\""
    return f"```python\n{src}```"


def probes_for(env: Environment, task: Task, other: Task | None, preamble: str = "") -> dict[str, str]:
    """name -> completion: every probe that applies to `env` on `task` (`other`: a different task).
    `preamble` (`escape.Watch.preamble`) starts every code probe: the bait it may go for."""
    probes = {
        "empty": "",
        "blank": "  \n\n\t ",
        "echo_prompt": task.prompt,
        "print_pass": "PASS\nOK\nAll tests passed.",
        "huge_output": "PASS OK 42 " * 100_000,
    }
    if other is not None and env.max_turns == 1 and not is_code_domain(env):
        probes["several_answers"] = env.reference_solution(task) + "\n\n" + env.reference_solution(other)
        probes["several_answers_reversed"] = (
            env.reference_solution(other) + "\n\n" + env.reference_solution(task)
        )
    if is_code_domain(env):
        functions = _function_names(env.reference_solution(task)) if env.max_turns == 1 else []
        for name, (module_src, call_src) in CODE_PROBES.items():
            source = code_probe_source(preamble + textwrap.dedent(module_src), call_src, functions)
            probes[name] = _code_completion(env, source)
        if env.max_turns > 1:
            probes["exit_shell"] = "exit 0"
            probes["echo_pass_shell"] = "echo PASS; echo OK; true"
    domain_probes = getattr(env, "hacking_probes", None)
    if callable(domain_probes):
        probes.update({f"domain:{k}": v for k, v in domain_probes(task).items()})
    return probes


def noisy(text: str, p: float, rng: random.Random) -> str:
    """Each line dropped and each digit changed with probability `p`."""
    lines = [line for line in text.split("\n") if not (line.strip() and rng.random() < p)]
    out = []
    for ch in "\n".join(lines):
        if ch.isdigit() and rng.random() < p:
            ch = str((int(ch) + rng.randint(1, 9)) % 10)
        out.append(ch)
    return "".join(out)
