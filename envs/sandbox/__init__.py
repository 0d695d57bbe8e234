"""Running untrusted, model-written commands in a sandbox.

`python -m envs.sandbox` prints the isolation this machine gives and the start latency.

    box        `Sandbox`, `run_once`, `Limits`, the isolation levels (the host's API)
    launch     the host's side of a run's start: the zygote client, the cold path, the run's wait
    plan       the mount plan a run sees (own backend and bubblewrap alike)
    workroot   this process's private root of sandbox work dirs, removed when the process goes
    cgroups    per-run cgroup v2 limits where a cgroup is delegated
    zygote     the stdlib-only process that forks children of runs (run as a script)
    child      a run's side from fork to exec (stdlib only; run as a script on the cold path)
    watchdog   the memory watchdog of a run (stdlib only)
    messages   messages and fds between the host, the zygote and a run (stdlib only)
    mounts     the mount system calls behind the plan (stdlib only)

The stdlib-only modules run in processes started with `python -I -S` and import each other by plain name;
importers name the submodule (`from envs.sandbox import box`).
"""
