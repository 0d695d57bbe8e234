"""The engine's CPU dot kernels by matmul row count and CPU (`inference.steps.dot_options`): on an x86-64 CPU
without AVX-512, decode-size steps compile their dots outside YNNPACK; larger ones, and every step elsewhere,
keep XLA:CPU's default."""

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


@pytest.fixture
def eigen_cpu(monkeypatch):
    """The rule as on a CPU where Eigen wins at decode sizes, whatever this host is."""
    monkeypatch.setattr(steps, "EIGEN_SMALL_DOTS", True)
    steps.jitted.cache_clear()  # steps built before under the host's rule
    yield
    steps.jitted.cache_clear()


def test_the_rule_by_rows_and_platform(eigen_cpu):
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


def test_other_cpus_keep_xla_defaults(monkeypatch):
    monkeypatch.setattr(steps, "EIGEN_SMALL_DOTS", False)
    assert all(steps.dot_options(rows, "cpu") is None for rows in (1, 4, 16, 32, 64))


AMD_AVX2 = (
    "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
)
INTEL_AVX512 = "processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512dq avx512bw amx_tile\n"


def test_the_cpu_rule_reads_the_flags():
    assert steps.x86_without_avx512("x86_64", AMD_AVX2)
    assert not steps.x86_without_avx512("x86_64", INTEL_AVX512)
    assert not steps.x86_without_avx512("aarch64", AMD_AVX2)  # no data there: XLA's defaults
    assert not steps.x86_without_avx512("x86_64", "")  # nothing known
    # A machine whose processors disagree (a hybrid CPU) counts as AVX-512 if any has it.
    assert not steps.x86_without_avx512("x86_64", AMD_AVX2 + INTEL_AVX512)


def _compiled_text(rows: int) -> str:
    cfg = tiny.get_config()
    m = model.build(cfg, seed=0)
    graphdef, params = nnx.graphdef(m), nnx.state(m, nnx.Param)
    arrays = sampling.sampling_arrays([sampling.SamplingParams()] * 2)
    fn = steps.jitted("score", graphdef, rows=rows)
    return fn.lower(params, jnp.ones((2, 8), jnp.int32), arrays).compile().as_text()


def test_small_steps_compile_their_dots_outside_ynnpack(eigen_cpu):
    if jax.default_backend() != "cpu" or not steps._no_ynn_supported():
        pytest.skip("an XLA:CPU option")
    assert "__ynn_fusion" in _compiled_text(0)  # the default sends the model's matmuls to YNNPACK
    assert "__ynn_fusion" not in _compiled_text(16)
    assert "__ynn_fusion" in _compiled_text(64)


def test_the_engine_passes_its_row_counts():  # the row counts, whatever the host's rule
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
