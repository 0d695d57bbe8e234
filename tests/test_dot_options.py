"""The engine's CPU dot kernels by matmul row count (`inference.steps.dot_options`): decode-size steps compile
their dots outside YNNPACK, larger ones keep XLA:CPU's default."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import model
from configs import tiny
from inference import sampling, steps
from inference.drafters import NgramDrafter
from inference.engine import Engine, EngineConfig

NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def test_the_rule_by_rows_and_platform():
    if not steps._no_ynn_supported():
        pytest.skip("this jaxlib has no xla_cpu_experimental_ynn_fusion_type")
    assert (steps.SMALL_DOT_MIN_ROWS, steps.SMALL_DOT_ROWS) == (4, 32)
    assert steps.dot_options(1, "cpu") is None  # a matrix-vector product: YNNPACK is as fast or faster
    assert steps.dot_options(3, "cpu") is None
    assert steps.dot_options(4, "cpu") == NO_YNN
    assert steps.dot_options(32, "cpu") == NO_YNN
    assert steps.dot_options(33, "cpu") is None
    assert steps.dot_options(0, "cpu") is None  # rows not known (bucketed prefill, scoring)
    assert steps.dot_options(16, "gpu") is None
    assert steps.dot_options(16, "tpu") is None


def _compiled_text(rows: int) -> str:
    cfg = tiny.get_config()
    m = model.build(cfg, seed=0)
    graphdef, params = nnx.graphdef(m), nnx.state(m, nnx.Param)
    arrays = sampling.sampling_arrays([sampling.SamplingParams()] * 2)
    fn = steps.jitted("score", graphdef, rows=rows)
    return fn.lower(params, jnp.ones((2, 8), jnp.int32), arrays).compile().as_text()


def test_small_steps_compile_their_dots_outside_ynnpack():
    if jax.default_backend() != "cpu" or not steps._no_ynn_supported():
        pytest.skip("an XLA:CPU option")
    assert "__ynn_fusion" in _compiled_text(0)  # the default sends the model's matmuls to YNNPACK
    assert "__ynn_fusion" not in _compiled_text(16)
    assert "__ynn_fusion" in _compiled_text(64)


def test_the_engine_passes_its_row_counts():
    cfg = tiny.get_config()
    params = nnx.state(model.build(cfg, seed=0), nnx.Param)
    ecfg = EngineConfig(
        max_batch=4, max_seq_len=32, page_size=8, prefill_chunk=16, min_bucket=16, num_draft=2
    )
    eng = Engine(cfg, params, ecfg)
    g = eng._graphdef
    assert eng._decode is steps.jitted("decode", g, place=None, rows=4)
    spec = Engine(cfg, params, ecfg, draft=NgramDrafter(3))
    assert spec._spec is steps.jitted("spec_tokens", g, spec.vocab, "residual", place=None, rows=4 * 3)
