"""python -m inference.serve --workdir=runs/<run> [--step=N] | --hf_dir=DIR | --config=configs/tiny.py
[--mesh=expert:2,tensor:2]

The OpenAI-compatible HTTP server's CLI: loads a training run's weights (`--workdir`, its latest checkpoint or
`--step`), a Hugging Face directory (`--hf_dir`, `model.hf.load_model`) or a config with random weights
(`--config`, for tests and benchmarks) through `inference.serve.load`, builds `inference.serve.server.Server`
(a plain engine and, unless `--draft=none`, a `-fast` one with a speculative drafter) and serves it on
`--host` / `--port` with uvicorn.

`--mesh=expert:2,tensor:2` (axes of `model.sharding.MESH_AXES`, data the rest) runs both engines sharded
over this process's devices in the inference layout (`inference.layout`), sharing one copy of the weights;
with `--hf_dir` every parameter is read straight into that layout, a model larger than one device included.
"""

from __future__ import annotations

import os
import sys

from absl import flags
from ml_collections import config_flags

from configs import cli
from configs.engine import EngineConfig
from configs.errors import UserError, require
from inference.serve.load import DRAFTS, load_hf, load_random, load_run, parse_mesh
from inference.serve.server import Server


def main() -> None:
    given = cli.config_given(sys.argv)
    cli.take_block_overrides(sys.argv, every=not given)  # --config.rl.<block>.<key>=... (configs/cli.py)
    if not given and cli.taken():  # --workdir / --hf_dir: the model is the run's or the checkpoint's
        cli.exit_with(
            f"--config.{cli.taken()[0][0]}: config overrides need --config (a run or a checkpoint is served "
            "as saved)"
        )
    config = config_flags.DEFINE_config_file(
        "config", None, "Model config (random weights), e.g. configs/tiny.py.", allow_override=True
    )
    workdir = flags.DEFINE_string(
        "workdir", None, "A training run directory (config.json, checkpoints/).", allow_override=True
    )
    step = flags.DEFINE_integer("step", None, "With --workdir: the checkpoint step (default: the latest).")
    hf_dir = flags.DEFINE_string("hf_dir", None, "A Hugging Face checkpoint directory.")
    mesh_flag = flags.DEFINE_string(
        "mesh",
        None,
        "Run the engines sharded on a mesh of this process's devices, e.g. expert:2,tensor:2 (data: the "
        "rest); default: one device.",
    )
    tokenizer = flags.DEFINE_string(
        "tokenizer", None, "Tokenizer directory or 'byte' (default: the model's)."
    )
    host = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
    port = flags.DEFINE_integer("port", 8000, "Port to bind.")
    name = flags.DEFINE_string(
        "served_model_name", None, "Model name (default: the run/directory/config name)."
    )
    draft = flags.DEFINE_enum(
        "draft", "auto", DRAFTS, "The -fast variant's drafter (auto: mtp if the model has it)."
    )
    num_draft = flags.DEFINE_integer(
        "num_draft", EngineConfig.num_draft, "Tokens proposed per speculative step."
    )
    route = flags.DEFINE_integer(
        "route_fast_below", 0, "Route unseeded plain requests to -fast below N sequences."
    )
    max_batch = flags.DEFINE_integer("max_batch", EngineConfig.max_batch, "Decode slots per engine.")
    max_seq_len = flags.DEFINE_integer(
        "max_seq_len", EngineConfig.max_seq_len, "Prompt + completion tokens of one sequence."
    )
    page_size = flags.DEFINE_integer("page_size", EngineConfig.page_size, "Tokens per KV page.")
    prefill_chunk = flags.DEFINE_integer(
        "prefill_chunk", EngineConfig.prefill_chunk, "Longest prefill call (a power of two)."
    )
    prefill_batch = flags.DEFINE_integer(
        "prefill_batch", EngineConfig.prefill_batch, "Rows per prefill call (a power of two)."
    )
    num_pages = flags.DEFINE_integer(
        "num_pages",
        EngineConfig.num_pages,
        "KV pages per engine (0: enough for max_batch full sequences and the prefix cache).",
    )
    prefix_cache_pages = flags.DEFINE_integer(
        "prefix_cache_pages",
        EngineConfig.prefix_cache_pages,
        "Device pages the prefix cache may keep (-1: the engine's default; 0: off).",
    )
    host_cache_pages = flags.DEFINE_integer(
        "host_cache_pages",
        EngineConfig.host_cache_pages,
        "Host-memory pages for cold prefix blocks, e.g. long shared system prompts (0: off).",
    )
    max_queue = flags.DEFINE_integer(
        "max_queue", 64, "Sequences that may wait beyond the decode slots (429 past)."
    )
    max_n = flags.DEFINE_integer("max_n", 16, "Largest n per request.")
    seed = flags.DEFINE_integer("seed", 0, "With --config: the random weights' seed.")
    warmup = flags.DEFINE_bool("warmup", True, "Compile every step shape before serving (503 until then).")

    def _main(argv) -> None:
        require("fastapi", "python -m inference.serve")
        uvicorn = require("uvicorn", "python -m inference.serve")
        if len(argv) > 1:
            raise UserError(f"unexpected arguments {list(argv[1:])}; flags look like --port=8000")
        given = [
            f
            for f, v in (("--workdir", workdir.value), ("--hf_dir", hf_dir.value), ("--config", config.value))
            if v
        ]
        if len(given) != 1:
            raise UserError(f"give exactly one of --workdir, --hf_dir, --config (got {given or 'none'})")
        mesh = parse_mesh(mesh_flag.value)  # before minutes of loading and compiling, as the port
        cli.check_port(host.value, port.value)
        cli.quiet_console(workdir.value or None)
        if hf_dir.value and not os.path.isfile(os.path.join(hf_dir.value, "config.json")):
            raise UserError(
                f"--hf_dir={hf_dir.value} holds no config.json: give a Hugging Face checkpoint dir"
            )
        ecfg = EngineConfig(
            max_batch=max_batch.value,
            max_seq_len=max_seq_len.value,
            page_size=page_size.value,
            prefill_chunk=prefill_chunk.value,
            prefill_batch=prefill_batch.value,
            num_draft=num_draft.value,
            num_pages=num_pages.value,
            prefix_cache_pages=prefix_cache_pages.value,
            host_cache_pages=host_cache_pages.value,
        )
        if workdir.value:
            loaded = load_run(
                workdir.value, step.value, tokenizer=tokenizer.value, mesh=mesh, engine_cfg=ecfg
            )
        elif hf_dir.value:
            loaded = load_hf(hf_dir.value, tokenizer=tokenizer.value, mesh=mesh, engine_cfg=ecfg)
        else:
            path = config_flags.get_config_filename(flags.FLAGS["config"])
            loaded = load_random(
                cli.with_block_overrides(config.value),
                name=_config_name(path),
                seed=seed.value,
                tokenizer=tokenizer.value,
            )
        if name.value:
            loaded.name = name.value
        server = Server.build(
            loaded,
            ecfg,
            draft=draft.value,
            max_queue=max_queue.value,
            max_n=max_n.value,
            route_fast_below=route.value,
            warmup=warmup.value,
            mesh=mesh,
        )
        loaded.weights = None  # the engines hold theirs (a copy unless they were placed)
        server.start()
        print(f"serving {', '.join(server.loops)} on http://{host.value}:{port.value}/v1", file=sys.stderr)
        try:
            uvicorn.run(server.app(), host=host.value, port=port.value, log_level="info")
        finally:
            server.stop()

    cli.run(_main)


def _config_name(spec: str) -> str:
    """configs/tiny.py -> tiny, configs/tiny.py:dense -> tiny-dense."""
    path, _, arg = spec.partition(":")
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{stem}-{arg.replace(',', '-')}" if arg else stem


if __name__ == "__main__":
    main()
