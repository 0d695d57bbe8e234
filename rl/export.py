"""python -m rl.export --workdir=runs/tiny --out=exported [--step=N]

A run's train state (its latest checkpoint, or `--step`) as a Hugging Face checkpoint that transformers'
`from_pretrained` and `model.io.hf.load` read:

- the weights by `model.io.hf.save`: the params, the sigmoid routers' selection biases
  (`e_score_correction_bias`, from `TrainState.model_state`) and the multi-token-prediction modules;
- config.json: the rl.init_from checkpoint's, updated with the run's model fields (the run's `hf` block, kept
  in `<workdir>/config.json`); a run of our own model gets its `model.io.hf_config.default_architecture`;
- the tokenizer files, when the run used a Hugging Face tokenizer directory (rl.tokenizer, which
  rl.init_from sets to the checkpoint's when it has one).

The run's config and checkpoint are read as `rl.evaluate` reads them (`configs.runs.read_config`,
`rl.run.restore_state`), onto the trainer's mesh (the run's mesh.shape over this job's devices; one device
where a single process's devices do not fit it). Across processes every process runs the command
(`rl.distributed`, as `rl.train`) with --out on a file system they share: no process gathers the model,
each writes the safetensors files of the tensors it holds (`model.io.hf.save`), process 0 the index,
config.json and the tokenizer files.
A model no supported format holds (`model.io.hf_config.to_hf`), or an --out that is a file or a non-empty
directory, is refused before the checkpoint is read; --out appears complete or not at all.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from absl import flags

from configs import cli
from configs.errors import UserError, require
from configs.runs import read_config
from rl import distributed, train_state
from rl import run as run_dir

# What `model.io.tokenizer.HFTokenizer.from_dir` reads (generation_config.json: extra stop ids), and the slow
# tokenizer files transformers reads when tokenizer.json is absent.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "additional_chat_templates",
    "generation_config.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


class ExportRefused(UserError, ValueError):
    """The run cannot be exported as asked (its model has no supported format, or --out holds files); raised
    before the checkpoint is read. The CLI prints it as one line."""


def tokenizer_files(source: str) -> list[str]:
    """The names of the `TOKENIZER_FILES` present in the directory `source`."""
    return [
        n
        for n in TOKENIZER_FILES
        if os.path.isfile(os.path.join(source, n)) or os.path.isdir(os.path.join(source, n))
    ]


def copy_tokenizer(source: str, out: str) -> list[str]:
    """Copies the `TOKENIZER_FILES` present in the directory `source` into `out`; returns their names."""
    copied = tokenizer_files(source)
    for name in copied:
        path = os.path.join(source, name)
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(out, name), dirs_exist_ok=True)
        else:
            shutil.copy2(path, os.path.join(out, name))
    return copied


def export(workdir: str, out: str, *, step: int | None = None, cfg: Any = None) -> dict[str, Any]:
    """Writes the checkpoint of `workdir` at `step` (default: the latest) into `out` as a Hugging Face
    checkpoint; returns {"step", "tokenizer_files"}. `cfg`: the run's config (default:
    `<workdir>/config.json`). Raises `ExportRefused` (a ValueError), before reading the checkpoint, when no
    supported format holds the model or `out` is a file or a non-empty directory. The files are written into
    a new directory beside `out` and renamed to it at the end; on any error nothing is left. Across processes
    every process calls it alike (see the module docstring) and returns once `out` is complete."""
    require("safetensors", "python -m rl.export (Hugging Face checkpoints)")
    from model.io import hf, hf_config

    cfg = cfg if cfg is not None else read_config(workdir)
    try:
        hf_config.to_hf(cfg)
    except ValueError as e:
        raise ExportRefused(f"cannot export the run in {workdir}: {e}") from None
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ExportRefused(f"--out={out} is a file; give a new or empty directory")
    if os.path.isdir(out) and os.listdir(out):
        raise ExportRefused(f"--out={out} is a directory with files in it; give a new or empty directory")
    distributed.initialize()
    state, meta = run_dir.restore_state(cfg, workdir, step, mesh=_mesh(cfg))
    tokenizer = cfg.rl.tokenizer
    has_tokenizer = bool(tokenizer) and os.path.isdir(tokenizer)
    with _staged(out) as staging:
        hf.save(cfg, train_state.weights(state), staging)
        if has_tokenizer and distributed.is_primary():
            copy_tokenizer(tokenizer, staging)
    return {"step": meta.get("step"), "tokenizer_files": tokenizer_files(tokenizer) if has_tokenizer else []}


def _mesh(cfg: Any) -> Any:
    """The trainer's mesh (`rl.distributed.trainer_mesh`): no device holds more than its share of the state.
    A single process whose devices the run's mesh.shape does not fit (a pod's run exported on a laptop)
    restores on one device instead."""
    import jax

    try:
        return distributed.trainer_mesh(cfg)
    except ValueError:
        if jax.process_count() > 1:
            raise
        return None


@contextlib.contextmanager
def _staged(out: str) -> Iterator[str]:
    """A new directory beside `out` (same file system), renamed to `out` when the block succeeds (an empty
    `out` is replaced); on an error it is removed, with the parent directories made for it. Across
    processes: one directory for all, named by process 0, which makes, renames and removes it; the others
    wait for it at each step (`rl.distributed.barrier`)."""
    primary = distributed.is_primary()
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    made = []  # missing ancestors, deepest first
    d = parent
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    token = int(distributed.allgather([random.getrandbits(24)])[0, 0])  # process 0's (f32 on the wire)
    staging = os.path.join(parent, f".{os.path.basename(out)}.partial-{token:06x}")
    if primary:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(staging)
    distributed.barrier("rl.export:staged")
    try:
        yield staging
        distributed.barrier("rl.export:written")  # every process's files are in place
        if primary:
            os.replace(staging, out)
        distributed.barrier("rl.export:renamed")
    except BaseException:
        if primary:
            shutil.rmtree(staging, ignore_errors=True)
            for d in made:
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        raise


def main() -> None:
    workdir = flags.DEFINE_string("workdir", None, "Run directory (config.json, checkpoints/).")
    out = flags.DEFINE_string("out", None, "Directory to write the Hugging Face checkpoint into.")
    step = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.mark_flags_as_required(["workdir", "out"])

    def _main(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise UserError(f"unexpected arguments {list(argv[1:])}; flags look like --workdir=DIR")
        cli.quiet_console(workdir.value)
        report = export(workdir.value, out.value, step=step.value)
        extra = f" and {len(report['tokenizer_files'])} tokenizer files" if report["tokenizer_files"] else ""
        if distributed.is_primary():  # across processes: said once
            print(f"wrote step {report['step']}{extra} to {out.value}", file=sys.stderr)

    cli.run(_main)


if __name__ == "__main__":
    main()
