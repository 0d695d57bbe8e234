"""What `inference.serve` serves: a run's checkpoint, a Hugging Face directory or random weights, and the
drafter of its fast variant.

`load_run` restores a training run as `rl.evaluate` does (`rl.evaluate.load_run_config` and `restore_state`:
the run's config, its latest checkpoint or a given step, the selection biases with the params) and is the
only place `inference` imports `rl`, inside the function: the server of a run needs the run's formats.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from inference.drafters import MTPDrafter, NgramDrafter
from model.tokenizer import Tokenizer, load_tokenizer

DRAFTS = ("auto", "ngram", "mtp", "none")


@dataclasses.dataclass
class Loaded:
    """What the server serves: the model config, its weights (a module or the engine's weight state), the
    tokenizer and the served name."""

    cfg: Any
    weights: Any
    tokenizer: Tokenizer
    name: str


def load_run(workdir: str, step: int | None = None, *, tokenizer: str | None = None) -> Loaded:
    """A training run's checkpoint (latest, or `step`) with the run's config and tokenizer."""
    from rl import evaluate, train_step

    cfg = evaluate.load_run_config(workdir)
    state, _ = evaluate.restore_state(cfg, workdir, step)
    tok = load_tokenizer(tokenizer or cfg.rl.tokenizer or None, vocab_size=cfg.model.vocab_size)
    return Loaded(cfg, train_step.weights(state), tok, _name(workdir))


def load_hf(directory: str, *, tokenizer: str | None = None) -> Loaded:
    """A Hugging Face checkpoint directory; its tokenizer unless `tokenizer` names another ("byte": ours)."""
    from configs.errors import require

    require("safetensors", "--hf_dir (a Hugging Face checkpoint)")
    from model import hf

    cfg, module = hf.load_model(directory)
    return Loaded(
        cfg, module, load_tokenizer(tokenizer or directory, vocab_size=cfg.model.vocab_size), _name(directory)
    )


def load_random(cfg, *, name: str, seed: int = 0, tokenizer: str | None = None) -> Loaded:
    """Random weights for `cfg` (a model config, or a main-job config whose rl.tokenizer is used)."""
    import model

    if tokenizer is None and "rl" in cfg:
        tokenizer = cfg.rl.tokenizer or None
    return Loaded(
        cfg, model.build(cfg, seed=seed), load_tokenizer(tokenizer, vocab_size=cfg.model.vocab_size), name
    )


def _name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)) or "model"


def make_drafter(cfg, kind: str = "auto", *, ngram: int = 3):
    """The fast variant's drafter: `auto` is the MTP head when the model has one, else `NgramDrafter(ngram)`;
    `none` serves no fast variant."""
    if kind not in DRAFTS:
        raise ValueError(f"--draft={kind!r} is not one of {DRAFTS}.")
    if kind == "auto":
        kind = "mtp" if cfg.model.mtp_layers else "ngram"
    if kind == "mtp":
        return MTPDrafter()
    return NgramDrafter(ngram) if kind == "ngram" else None
