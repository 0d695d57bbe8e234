"""The tasks of domain `terminal`: three families (files, logs, repair), each at levels 0..3 (`_GENERATORS`).
A task's metadata holds what the agent gets (prompt, files, setup), how to solve it (`reference`, and the
command `flaky` the disturbance breaks once) and how to verify it (`checks`, `hidden` inputs: never shown).
"""

from __future__ import annotations

import collections
import random

from envs.base import Task

LEVELS = (0, 1, 2, 3)
FAMILIES = ("files", "logs", "repair")

_NAMES = ("ana", "bob", "chen", "dara", "eli", "fay", "gus", "hana", "ivo", "june", "kai", "lena")
_CITIES = ("Berlin", "Cairo", "Delhi", "Lima", "Oslo", "Paris", "Quito", "Rome", "Seoul", "Tokyo")
_WORDS = ("alpha", "beta", "gamma", "delta", "fix", "ship", "review", "note", "todo", "idea", "later")


def _spec(
    prompt: str, files: dict[str, str], reference: list[str], flaky: str, checks: list[dict], **kw
) -> dict:
    """A task's metadata: what the agent gets, how to solve it, and how to verify it (never shown)."""
    return {
        "prompt": prompt,
        "files": files,
        "modes": kw.get("modes", {}),
        "setup": kw.get("setup", []),
        "reference": reference,
        "flaky": flaky,
        "checks": checks,
        "hidden": kw.get("hidden", {}),
        "exec": kw.get("exec"),
    }


def _answer(expected: str) -> list[dict]:
    """The checks of a task whose answer is the content of `answer.txt`."""
    return [{"kind": "file", "path": "answer.txt", "expected": expected}]


def _ts(rng: random.Random, i: int) -> str:
    return f"2024-03-{1 + i // 1440:02d}T{i // 60 % 24:02d}:{i % 60:02d}:{rng.randint(0, 59):02d}"


def _files_count(rng: random.Random) -> dict:
    lines = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(15, 30))
    ]
    marked = rng.sample(range(len(lines)), rng.randint(1, 6))
    for i in marked:
        lines[i] += " TODO"
    prompt = (
        "Create the directory `out` and in it the file `summary.txt` containing the number of lines of "
        "`notes.txt` that contain `TODO` (upper case only)."
    )
    reference = ["mkdir -p out", "grep -c TODO notes.txt > out/summary.txt"]
    checks = [{"kind": "file", "path": "out/summary.txt", "expected": str(len(marked))}]
    return _spec(prompt, {"notes.txt": "\n".join(lines) + "\n"}, reference, "grep", checks)


def _files_column(rng: random.Random) -> dict:
    columns = rng.sample(["name", "city", "age"], 3)
    rows = [
        {"name": rng.choice(_NAMES), "city": rng.choice(_CITIES), "age": str(rng.randint(18, 90))}
        for _ in range(25)
    ]
    text = ",".join(columns) + "\n" + "".join(",".join(r[c] for c in columns) + "\n" for r in rows)
    prompt = (
        "`people.csv` is a CSV file with a header row. Write to `cities.txt` the distinct values of its "
        "`city` column, sorted alphabetically, one per line."
    )
    reference = [f"tail -n +2 people.csv | cut -d, -f{columns.index('city') + 1} | sort -u > cities.txt"]
    checks = [
        {"kind": "file", "path": "cities.txt", "expected": "\n".join(sorted({r["city"] for r in rows}))}
    ]
    return _spec(prompt, {"people.csv": text}, reference, "sort", checks)


def _files_rename(rng: random.Random) -> dict:
    numbers = rng.sample(range(1, 3000), rng.randint(4, 8))
    files, expected = {}, {}
    for i, n in enumerate(numbers):
        name = f"IMG_{n:03d}.jpg" if i % 3 == 0 else f"IMG_{n}.jpg"
        files[f"photos/{name}"] = expected[f"photo_{n:04d}.jpg"] = f"jpeg {n} {rng.random()}\n"
    for name in ("IMG_12.png", "IMG_3a.jpg", "notes.txt", "IMG_.jpg", "IMG_5.jpg.bak"):
        files[f"photos/{name}"] = expected[name] = f"other {name}\n"
    prompt = (
        "In the directory `photos`, rename every file named `IMG_<digits>.jpg` to `photo_<number>.jpg`, with "
        "the number zero-padded to 4 digits (IMG_7.jpg and IMG_007.jpg both become photo_0007.jpg). Leave "
        "every other file as it is."
    )
    reference = [
        "cd photos && for f in IMG_*.jpg; do n=${f#IMG_}; n=${n%.jpg}; case $n in ''|*[!0-9]*) continue;; "
        'esac; mv -- "$f" "$(printf \'photo_%04d.jpg\' "$((10#$n))")" || exit 1; done'
    ]
    return _spec(prompt, files, reference, "mv", [{"kind": "tree", "dir": "photos", "expected": expected}])


def _files_aggregate(rng: random.Random) -> dict:
    customers = rng.sample(_NAMES, rng.randint(3, 6))
    orders = [(f"o{i:03d}", rng.choice(customers), rng.randint(1, 500)) for i in range(rng.randint(10, 25))]
    totals = collections.Counter()
    for _, customer, amount in orders:
        totals[customer] += amount
    lines = ["customer,total"] + [
        f"{c},{t}" for c, t in sorted(totals.items(), key=lambda ct: (-ct[1], ct[0]))
    ]
    prompt = (
        "`orders.csv` has the columns order_id,customer,amount (integers). Write `totals.csv` with the "
        "header `customer,total` and one row per customer with the sum of their amounts, sorted by total "
        "(largest first), ties by customer name."
    )
    text = "order_id,customer,amount\n" + "".join(f"{o},{c},{a}\n" for o, c, a in orders)
    reference = [
        "{ echo customer,total; awk -F, 'NR > 1 {t[$2] += $3} END {for (c in t) print c \",\" t[c]}' "
        "orders.csv | sort -t, -k2,2nr -k1,1; } > totals.csv"
    ]
    checks = [{"kind": "file", "path": "totals.csv", "expected": "\n".join(lines)}]
    return _spec(prompt, {"orders.csv": text}, reference, "sort", checks)


def _logs_count(rng: random.Random) -> dict:
    lines, errors = [], 0
    for i in range(rng.randint(30, 60)):
        level = rng.choice(("INFO", "INFO", "WARN", "DEBUG", "ERROR"))
        errors += level == "ERROR"
        message = (
            "retrying after ERROR upstream" if level == "INFO" and rng.random() < 0.3 else rng.choice(_WORDS)
        )
        lines.append(f"{_ts(rng, i)} {level} {message}")
    prompt = "Write to `answer.txt` the number of lines of `app.log` whose level (second field) is ERROR."
    reference = ["awk '$2 == \"ERROR\"' app.log | wc -l > answer.txt"]
    checks = _answer(str(errors))
    return _spec(prompt, {"app.log": "\n".join(lines) + "\n"}, reference, "awk", checks)


def _unique_top(rng: random.Random, keys: list[str], n: int) -> list[str]:
    """`n` draws from `keys` in which the first key is strictly the most frequent."""
    draws = [keys[0]] * (n // len(keys) + 2) + [rng.choice(keys[1:]) for _ in range(n)]
    while collections.Counter(draws).most_common(2)[1][1] >= draws.count(keys[0]):
        draws.append(keys[0])
    rng.shuffle(draws)
    return draws


def _logs_request(rng: random.Random) -> dict:
    ids = [f"r{rng.randint(1000, 9999)}" for _ in range(6)]
    errors = _unique_top(rng, ids, 15)
    lines = [("ERROR", r) for r in errors] + [
        (rng.choice(("INFO", "WARN")), rng.choice(ids)) for _ in range(30)
    ]
    rng.shuffle(lines)
    text = "".join(f"{_ts(rng, i)} {lvl} req={r} {rng.choice(_WORDS)}\n" for i, (lvl, r) in enumerate(lines))
    prompt = (
        "Each line of `app.log` reads `<time> <LEVEL> req=<request id> <message>`. Find the request id with "
        "the most ERROR lines and write just that id (e.g. r1234) to `answer.txt`."
    )
    reference = [
        "awk '$2 == \"ERROR\" {print $3}' app.log | sort | uniq -c | sort -k1,1nr | head -n 1 "
        "| awk '{print $2}' | cut -d= -f2 > answer.txt"
    ]
    checks = _answer(ids[0])
    return _spec(prompt, {"app.log": text}, reference, "uniq", checks)


def _logs_logins(rng: random.Random) -> dict:
    users = rng.sample(_NAMES, 5)
    failed = _unique_top(rng, users, 18)
    events = [("failed", u) for u in failed] + [("ok", rng.choice(users)) for _ in range(25)]
    rng.shuffle(events)
    files = {}
    for part in range(3):
        chunk = events[part::3]
        files[f"logs/auth-{part}.log"] = "".join(
            f"{_ts(rng, i)} sshd: login {kind} for user {user} from 10.0.{part}.{i % 250}\n"
            for i, (kind, user) in enumerate(chunk)
        )
    prompt = (
        "The directory `logs` holds authentication logs, some of them gzip-compressed. Across all of them, "
        "find the user with the most `login failed` lines and write just that user name to `answer.txt`."
    )
    reference = [
        "zcat -f logs/* | grep 'login failed for user' | awk '{print $7}' | sort | uniq -c | sort -k1,1nr "
        "| head -n 1 | awk '{print $2}' > answer.txt"
    ]
    checks = _answer(users[0])
    return _spec(prompt, files, reference, "zcat", checks, setup=["gzip logs/auth-1.log"])


def _logs_latency(rng: random.Random) -> dict:
    paths = rng.sample(["/api/users", "/api/orders", "/login", "/search", "/health", "/cart", "/pay"], 5)
    while True:
        requests = [
            (rng.choice(paths), rng.choice((200, 200, 200, 404, 500)), rng.randint(5, 900)) for _ in range(50)
        ]
        sums: dict[str, list[int]] = collections.defaultdict(list)
        for path, status, ms in requests:
            if status == 200:
                sums[path].append(ms)
        means = sorted(((sum(v) / len(v), p) for p, v in sums.items()), reverse=True)
        if len(means) > 1 and means[0][0] > means[1][0]:
            break
    text = "".join(f"{_ts(rng, i)} GET {p} {s} {ms}ms\n" for i, (p, s, ms) in enumerate(requests))
    prompt = (
        "Each line of `access.log` reads `<time> <METHOD> <path> <status> <latency>ms`. Considering only "
        "status 200, find the path with the highest mean latency and write to `answer.txt` the path, a "
        "space, and that mean rounded down to an integer (e.g. `/search 412`)."
    )
    reference = [
        'awk \'$4 == 200 {sub("ms", "", $5); s[$3] += $5; n[$3]++} END {for (p in s) printf "%s %d\\n", p, '
        "s[p] / n[p]}' access.log | sort -k2,2nr | head -n 1 > answer.txt"
    ]
    checks = _answer(f"{means[0][1]} {int(means[0][0])}")
    return _spec(prompt, {"access.log": text}, reference, "awk", checks)


def _lines(rng: random.Random) -> tuple[str, int]:
    lines = [rng.choice(("", "", " ".join(rng.sample(_WORDS, 3)))) for _ in range(rng.randint(8, 20))]
    return "\n".join(lines) + "\n", sum(1 for line in lines if line)


def _repair_exec_bit(rng: random.Random) -> dict:
    sample, _ = _lines(rng)
    hidden, count = _lines(rng)
    prompt = (
        "`./count.sh FILE` should print the number of non-empty lines of FILE, but running it fails. Fix it "
        "so that `./count.sh sample.txt` works (it will also be run on other files)."
    )
    files = {"count.sh": '#!/bin/bash\ngrep -c . "$1"\n', "sample.txt": sample}
    reference = ["chmod +x count.sh", "./count.sh sample.txt"]
    checks = [{"kind": "exec", "expected": str(count)}]
    return _spec(
        prompt, files, reference, "chmod", checks, hidden={"hidden.txt": hidden}, exec="./count.sh hidden.txt"
    )


_TOTAL_PY = """import csv
import sys

with open(sys.argv[1]) as f:
    rows = list(csv.reader(f))
col = rows[0].index("amount"){offset}
total = 0
for row in rows[1:{stop}]:
    total += int(row[col])
print(total)
"""


def _sales(rng: random.Random, columns: list[str]) -> tuple[str, int]:
    rows = [
        {"id": str(i), "amount": str(rng.randint(1, 999)), "qty": str(rng.randint(1, 9))} for i in range(12)
    ]
    text = ",".join(columns) + "\n" + "".join(",".join(r[c] for c in columns) + "\n" for r in rows)
    return text, sum(int(r["amount"]) for r in rows)


def _repair_script(rng: random.Random) -> dict:
    columns = rng.sample(["id", "amount", "qty"], 3)
    if rng.random() < 0.5:
        script, fix = _TOTAL_PY.format(offset="", stop="-1"), "sed -i 's/rows\\[1:-1\\]/rows[1:]/' total.py"
    else:
        script = _TOTAL_PY.format(offset=" + 1", stop="")
        fix = 'sed -i \'s/index("amount") + 1/index("amount")/\' total.py'
    sample, _ = _sales(rng, columns)
    hidden, total = _sales(rng, columns)
    prompt = (
        "`python3 total.py FILE` should print the sum of the `amount` column of the CSV file FILE (header "
        "row first, columns in any order), but it is wrong. Fix the script (it will be run on other files)."
    )
    files = {"total.py": script, "sales.csv": sample}
    checks = [{"kind": "exec", "expected": str(total)}]
    reference = [fix, "python3 total.py sales.csv"]
    return _spec(
        prompt,
        files,
        reference,
        "sed",
        checks,
        hidden={"hidden.csv": hidden},
        exec="python3 total.py hidden.csv",
    )


def _repair_make_tabs(rng: random.Random) -> dict:
    first, second = rng.sample(("header", "intro", "body", "notes", "footer"), 2)
    parts = {f"src/{name}.txt": f"{name}: {' '.join(rng.sample(_WORDS, 4))}\n" for name in (first, second)}
    hidden = {path: f"hidden {text}" for path, text in parts.items()}
    sources = " ".join(parts)
    makefile = f"build/report.txt: {sources}\n    mkdir -p build\n    cat {sources} > build/report.txt\n"
    prompt = (
        f"`make` should build `build/report.txt` (the concatenation of {sources}) but it fails. Fix the "
        "build so that `make` works; it will be rebuilt from scratch, with other contents in those files."
    )
    checks = [{"kind": "exec", "expected": "".join(hidden.values())}]
    reference = ["sed -i 's/^    /\\t/' Makefile", "make"]
    exec_cmd = "rm -rf build && make -s > /dev/null && cat build/report.txt"
    return _spec(
        prompt, {"Makefile": makefile, **parts}, reference, "sed", checks, hidden=hidden, exec=exec_cmd
    )


_RENDER_PY = """import csv
import sys

with open(sys.argv[1]) as f:
    rows = list(csv.reader(f))[1:]
for name, score in sorted(rows, key=lambda r: (r[1], r[0]), reverse=True):
    print(f"{name}: {score}")
"""


def _scores(rng: random.Random) -> tuple[str, str]:
    rows = [
        (name, rng.choice((7, 9, 12, 85, 100, 150, rng.randint(1, 200)))) for name in rng.sample(_NAMES, 8)
    ]
    table = "".join(f"{n}: {s}\n" for n, s in sorted(rows, key=lambda r: (-r[1], r[0])))
    return "name,score\n" + "".join(f"{n},{s}\n" for n, s in rows), table


def _repair_make_script(rng: random.Random) -> dict:
    sample, _ = _scores(rng)
    hidden, table = _scores(rng)
    makefile = (
        "build/table.txt: tools/render.py src/score.csv\n\tmkdir -p build\n"
        "\tpython3 tools/render.py src/score.csv > build/table.txt\n"
    )
    prompt = (
        "`make` should build `build/table.txt` from `src/scores.csv`: one `name: score` line per row, sorted "
        "by score (a number, highest first), ties by name. The build is broken in more than one way. Fix it "
        "so that `make` produces the right table; it will be rebuilt from scratch with other scores."
    )
    files = {"Makefile": makefile, "tools/render.py": _RENDER_PY, "src/scores.csv": sample}
    reference = [
        "sed -i 's#src/score.csv#src/scores.csv#g' Makefile",
        "sed -i 's/key=lambda r: (r\\[1\\], r\\[0\\]), reverse=True/key=lambda r: (-int(r[1]), r[0])/' "
        "tools/render.py",
        "make",
    ]
    checks = [{"kind": "exec", "expected": table}]
    exec_cmd = "rm -rf build && make -s > /dev/null && cat build/table.txt"
    return _spec(prompt, files, reference, "sed", checks, hidden={"src/scores.csv": hidden}, exec=exec_cmd)


_GENERATORS = {
    ("files", 0): _files_count,
    ("files", 1): _files_column,
    ("files", 2): _files_rename,
    ("files", 3): _files_aggregate,
    ("logs", 0): _logs_count,
    ("logs", 1): _logs_request,
    ("logs", 2): _logs_logins,
    ("logs", 3): _logs_latency,
    ("repair", 0): _repair_exec_bit,
    ("repair", 1): _repair_script,
    ("repair", 2): _repair_make_tabs,
    ("repair", 3): _repair_make_script,
}


def make_task(seed: int, index: int, level: int | None = None) -> Task:
    rng = random.Random(f"terminal:{seed}:{index}")
    level = rng.choice(LEVELS) if level is None else level
    family = rng.choice(FAMILIES)
    metadata = {"family": family, "level": level, **_GENERATORS[(family, level)](rng)}
    prompt = (
        f"{metadata['prompt']}\n\nYou are in a shell, in the task's work dir. Reply with one shell command "
        "per turn; each runs in a fresh `bash -c` started in the work dir (so `cd` does not carry over) and "
        "you see its output and exit code. There is no network. Reply `submit` when you are done."
    )
    return Task(f"terminal/{family}/{level}/{seed}-{index}", "terminal", prompt, metadata, level)
