"""rl.grpo's train-inference corrections (truncated importance weights, icepop, sequence masks) and the
mismatch metrics: golden values derived by hand in the comments."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import grpo

ATOL = 1e-5  # f32 arithmetic on values of order 1; every golden below is exact to ~1e-7.


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected, dtype=np.float32), rtol=0, atol=atol)


# --- truncated importance weights ---------------------------------------------------------------------------


def test_truncated_importance_weights_cap_mask_and_no_gradient():
    # proximal / behaviour = [1.5, 3, .5, 10]; cap 2 -> [1.5, 2, .5], the last token is masked -> 0.
    behaviour = jnp.array([[-1.0, -2.0, -0.5, -3.0]])
    proximal = behaviour + jnp.log(jnp.array([[1.5, 3.0, 0.5, 10.0]]))
    mask = jnp.array([[1, 1, 1, 0]], bool)
    close(grpo.truncated_importance_weights(proximal, behaviour, mask), [[1.5, 2.0, 0.5, 0.0]])
    close(grpo.truncated_importance_weights(proximal, behaviour, mask, cap=4.0), [[1.5, 3.0, 0.5, 0.0]])
    weight_sum = lambda p, b: grpo.truncated_importance_weights(p, b, mask).sum()
    gp, gb = jax.grad(weight_sum, argnums=(0, 1))(proximal, behaviour)
    close(gp, np.zeros((1, 4)), atol=0)
    close(gb, np.zeros((1, 4)), atol=0)
    with pytest.raises(ValueError, match=r"cap=0.0 must be positive"):
        grpo.truncated_importance_weights(proximal, behaviour, mask, cap=0.0)


def test_is_weights_scale_the_loss_as_constants():
    # r = 1, A = 1, weights [2, .5]: token losses -2, -.5 -> mean -1.25; d/d logp = -w / 2 = [-1, -.25];
    # no gradient reaches the weights.
    logp, w = jnp.zeros((1, 2)), jnp.array([[2.0, 0.5]])
    f = lambda lp, w: grpo.policy_loss(lp, jnp.zeros((1, 2)), jnp.ones(1), jnp.ones((1, 2)), is_weights_BT=w)[
        0
    ]
    loss, (g_logp, g_w) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(logp, w)
    close(loss, -1.25)
    close(g_logp, [[-1.0, -0.25]])
    close(g_w, [[0.0, 0.0]], atol=0)


# --- corrections and mismatch metrics -----------------------------------------------------------------------

# r = pi_proximal / pi_behaviour per token; band [.5, 2], cap 2.
#   row 0: [.4, 1, 3]            product 1.2 (in band), geometric mean 1.2^(1/3) = 1.0626586 (in)
#   row 1: [1.5, 1.5, pad 100]   product 2.25 (out), geometric mean 1.5 (in); the padded 100 is ignored
#   row 2: [.3, .55, .6]         product .099 (out), geometric mean .099^(1/3) = .4626065 (out)
CORR_R = jnp.array([[0.4, 1.0, 3.0], [1.5, 1.5, 100.0], [0.3, 0.55, 0.6]])
CORR_MASK = jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]], bool)
CORR_BEHAVIOUR = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5], [-0.2, -0.4, -0.6]])
CORR_PROXIMAL = CORR_BEHAVIOUR + jnp.log(CORR_R)
CORR_WEIGHTS = {
    "none": [[1, 1, 1], [1, 1, 0], [1, 1, 1]],
    "tis": [[0.4, 1, 2], [1.5, 1.5, 0], [0.3, 0.55, 0.6]],  # min(r, 2)
    "icepop": [[0, 1, 0], [1.5, 1.5, 0], [0, 0.55, 0.6]],  # r in [.5, 2], else 0
    "seq-mask": [[0.4, 1, 2], [1.5, 1.5, 0], [0, 0, 0]],  # row 2's geometric mean is out: 0
    "seq-reject": [[1, 1, 1], [0, 0, 0], [0, 0, 0]],  # rows 1 and 2's products are out: 0
}


@pytest.mark.parametrize("kind", sorted(CORR_WEIGHTS))
def test_correction_weights_golden_and_constant(kind):
    fn = lambda p, b: grpo.correction_weights(p, b, CORR_MASK, kind=kind, low=0.5, high=2.0, cap=2.0)
    w = jax.jit(fn)(CORR_PROXIMAL, CORR_BEHAVIOUR)
    chex.assert_shape(w, (3, 3))
    assert w.dtype == jnp.float32
    close(w, CORR_WEIGHTS[kind])
    gp, gb = jax.grad(lambda p, b: fn(p, b).sum(), argnums=(0, 1))(CORR_PROXIMAL, CORR_BEHAVIOUR)
    close(gp, np.zeros((3, 3)), atol=0)
    close(gb, np.zeros((3, 3)), atol=0)


def test_seq_mask_without_cap_and_wider_band():
    # cap 0 (truncation off): seq-mask keeps weight 1 on rows 0 and 1. Band [.25, 4]: every row's geometric
    # mean is in; products 1.2, 2.25 in, .099 out -> seq-reject keeps rows 0 and 1.
    w = grpo.correction_weights(CORR_PROXIMAL, CORR_BEHAVIOUR, CORR_MASK, kind="seq-mask", cap=0.0)
    close(w, [[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    w = grpo.correction_weights(CORR_PROXIMAL, CORR_BEHAVIOUR, CORR_MASK, kind="seq-mask", low=0.25, high=4.0)
    close(w, CORR_WEIGHTS["tis"])
    w = grpo.correction_weights(
        CORR_PROXIMAL, CORR_BEHAVIOUR, CORR_MASK, kind="seq-reject", low=0.25, high=4.0
    )
    close(w, [[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"kind='pop' is unknown; choose one of \['icepop', 'none'"):
        grpo.correction_weights(CORR_PROXIMAL, CORR_BEHAVIOUR, CORR_MASK, kind="pop")


@pytest.mark.parametrize(
    "correction, kept, mean",
    [
        # 8 masked tokens. Weights from CORR_WEIGHTS: nonzero counts 8, 8, 5, 5, 3.
        ("none", 1.0, 1.0),
        ("tis", 1.0, (3.4 + 3.0 + 1.45) / 8),  # row sums 3.4, 3, 1.45
        ("icepop", 5 / 8, 5.15 / 8),  # 1 + 1.5 + 1.5 + .55 + .6
        ("seq-mask", 5 / 8, 6.4 / 8),  # 3.4 + 3
        ("seq-reject", 3 / 8, 3 / 8),
    ],
)
def test_loss_from_config_applies_the_correction(correction, kept, mean):
    # logp = old (r = 1), A = [1, -1, 1]: token loss -A w; token-mean over the 8 masked tokens.
    cfg = _cfg(correction=correction)
    adv = jnp.array([1.0, -1.0, 1.0])
    loss, metrics = jax.jit(functools.partial(grpo.loss_from_config, cfg=cfg))(
        CORR_PROXIMAL, CORR_PROXIMAL, adv, CORR_MASK, behaviour_logp_BT=CORR_BEHAVIOUR
    )
    w = np.asarray(CORR_WEIGHTS[correction], np.float32)
    close(loss, -(w * np.asarray(adv)[:, None]).sum() / 8)
    close(metrics["correction_kept_fraction"], kept)
    close(metrics["is_weight_mean"], mean)
    assert ("tis_weight_mean" in metrics) == (correction == "tis")


def test_mismatch_metrics_golden():
    # r = train - behaviour: masked ratios [.4, 1, 3] and [1.5, .8]; the padded e^10 is ignored.
    # k1 = mean(-log r) = -log(.4 * 3 * 1.5 * .8) / 5 = -log 1.44 / 5 = -.0729286 (negative: k1 is unbiased,
    #   not nonnegative). k3 = mean(r - 1 - log r): .3162907 + 0 + .9013877 + .0945349 + .0231436 = 1.3353569,
    #   / 5 = .2670714. Band 2, [.5, 2]: .4 and 3 are out -> 2 / 5. Max 3, min .4.
    ratios = jnp.array([[0.4, 1.0, 3.0], [1.5, 0.8, math.exp(10.0)]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
    behaviour = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -jnp.inf]])
    train = jnp.where(mask, behaviour + jnp.log(ratios), 10.0)
    metrics = jax.jit(functools.partial(grpo.mismatch_metrics, band=2.0))(train, behaviour, mask)
    chex.assert_tree_all_finite(metrics)
    close(metrics["mismatch_kl_k1"], -0.0729286)
    close(metrics["mismatch_kl"], 0.2670714)
    close(metrics["mismatch_out_of_band"], 0.4)
    close(metrics["mismatch_ratio_max"], 3.0)
    close(metrics["mismatch_ratio_min"], 0.4)
    # Band 4, [.25, 4]: every ratio is in.
    close(grpo.mismatch_metrics(train, behaviour, mask, band=4.0)["mismatch_out_of_band"], 0.0, atol=0)
    with pytest.raises(ValueError, match=r"band=0.5 must be >= 1"):
        grpo.mismatch_metrics(train, behaviour, mask, band=0.5)


# --- loss_from_config ---------------------------------------------------------------------------------------

LOGP = jnp.array([[-1.0, -2.0], [-0.5, -1.5]])
TIS_W = jnp.array([[1.5, 3.0], [0.5, 1.0]])  # old / behaviour; 3 is capped to 2.
BEHAVIOUR = LOGP - jnp.log(TIS_W)
REF = LOGP - jnp.array([[0.4, 0.2], [0.0, -0.2]])  # k1 = logp - ref.
ADV = jnp.array([1.0, -1.0])


def _cfg(**kw):
    cfg = grpo.default_loss_config()
    cfg.update(kw)
    return cfg


def test_default_loss_config():
    cfg = grpo.default_loss_config()
    assert dict(cfg) == {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "ratio": "token",
        "aggregation": "token-mean",
        "max_tokens": 0,
        "kl_kind": "none",
        "kl_coef": 0.0,
        "correction": "tis",
        "correction_low": 0.5,
        "correction_high": 2.0,
        "tis_cap": 2.0,
    }


def test_loss_from_config_with_tis_and_kl():
    # logp = old (r = 1); TIS weights [[1.5, 2], [.5, 1]]; token losses -A w = [[-1.5, -2], [.5, 1]]
    # -> mean -.5.
    # k1 = [[.4, .2], [0, -.2]] -> mean .1; loss = -.5 + .1 * .1 = -.49. Mean weight 5 / 4 = 1.25.
    cfg = _cfg(kl_kind="k1", kl_coef=0.1)
    fn = jax.jit(functools.partial(grpo.loss_from_config, cfg=cfg))
    loss, metrics = fn(LOGP, LOGP, ADV, jnp.ones((2, 2), bool), behaviour_logp_BT=BEHAVIOUR, ref_logp_BT=REF)
    close(loss, -0.49)
    close(metrics["loss"], -0.49)
    close(metrics["policy_loss"], -0.5)
    close(metrics["kl"], 0.1)
    close(metrics["tis_weight_mean"], 1.25)
    # d loss / d logp = (-A w + .1 * 1) / 4 per token: [[-1.4, -1.9], [.6, 1.1]] / 4.
    grad = jax.grad(
        lambda lp: fn(lp, LOGP, ADV, jnp.ones((2, 2)), behaviour_logp_BT=BEHAVIOUR, ref_logp_BT=REF)[0]
    )
    close(grad(LOGP), [[-0.35, -0.475], [0.15, 0.275]])


def test_loss_from_config_tis_off_and_no_kl():
    # tis_cap 0: the behaviour log-probs are ignored; token losses [[-1, -1], [1, 1]] -> 0. No KL term.
    loss, metrics = grpo.loss_from_config(
        LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=_cfg(tis_cap=0.0), behaviour_logp_BT=BEHAVIOUR, ref_logp_BT=REF
    )
    close(loss, 0.0)
    assert "kl" not in metrics and "tis_weight_mean" not in metrics
    # Default config (tis_cap 2) but no behaviour log-probs: on-policy, the same 0.
    close(grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=_cfg())[0], 0.0)


def test_loss_from_config_k3_and_sum_norm():
    # k3 per token with d = ref - logp = [[-.4, -.2], [0, .2]]:
    #   e^-.4 + .4 - 1 = .0703200, e^-.2 + .2 - 1 = .0187308, 0, e^.2 - .2 - 1 = .0214028.
    # sum-norm, max_tokens 4: policy rows (-1 - 1) / 4 = -.5 and (1 + 1) / 4 = .5 -> mean 0;
    #   KL rows (.0703200 + .0187308) / 4 = .0222627, .0214028 / 4 = .0053507 -> mean .0138067; * coef 1.
    cfg = _cfg(kl_kind="k3", kl_coef=1.0, aggregation="seq-mean-token-sum-norm", max_tokens=4)
    loss, metrics = grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=cfg, ref_logp_BT=REF)
    close(metrics["kl"], 0.0138067)
    close(loss, 0.0138067)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"aggregation": "x"}, r"rl.loss.aggregation='x' is unknown; choose one of \['seq-mean-token-mean'"),
        ({"ratio": "seq"}, r"rl.loss.ratio='seq' is unknown; choose one of \['sequence', 'token'\]"),
        ({"kl_kind": "k2"}, r"rl.loss.kl_kind='k2' is unknown; choose one of \['k1', 'k3', 'none'\]"),
        ({"clip_low": -0.1}, r"rl.loss.clip_low=-0.1 must be >= 0"),
        ({"tis_cap": -1.0}, r"rl.loss.tis_cap=-1.0 must be >= 0"),
        ({"aggregation": "seq-mean-token-sum-norm"}, r"rl.loss.max_tokens=0 must be > 0 for aggregation="),
        ({"correction": "is"}, r"rl.loss.correction='is' is unknown; choose one of \['icepop', 'none'"),
        ({"correction_low": 0.0}, r"rl.loss.correction_low=0.0 must be in \(0, 1\]"),
        ({"correction_low": 1.5}, r"rl.loss.correction_low=1.5 must be in \(0, 1\]"),
        ({"correction_high": 0.9}, r"rl.loss.correction_high=0.9 must be >= 1"),
    ],
)
def test_loss_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=_cfg(**overrides))


def test_loss_config_missing_field_and_missing_ref():
    cfg = grpo.default_loss_config()
    del cfg["kl_coef"]
    with pytest.raises(ValueError, match=r"rl.loss.kl_coef is missing"):
        grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=cfg)
    with pytest.raises(ValueError, match=r"rl.loss.kl_kind='k1' needs ref_logp_BT"):
        grpo.loss_from_config(LOGP, LOGP, ADV, jnp.ones((2, 2)), cfg=_cfg(kl_kind="k1"))


# --- registry -----------------------------------------------------------------------------------------------
