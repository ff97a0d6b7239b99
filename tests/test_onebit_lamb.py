"""1-bit LAMB as an optax transform (reference test cases 10-24, 27): against a float64 numpy
reference of every stage, per-layer edge cases, factor bounds and their order, masks, identical
replicated state on every device, a convex ablation, and clear errors for misuse."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from onebit_reference import NumpyOnebitLamb

from meshtron.config import MeshConfig
from meshtron.mesh import build_mesh
from meshtron.optim import manual_part, onebit_lamb, opt_state_specs

pytestmark = pytest.mark.both_stacks

STACKED = {"blocks": True, "kernel": False, "bias": False}


def stacked_flags(params):
    return {k: STACKED.get(k, False) for k in params}


class Harness:
    """A hand-written data-parallel step: local gradients in (one row per worker), update out."""

    def __init__(self, tx, params, workers):
        self.tx, self.workers = tx, workers
        self.mesh = build_mesh(MeshConfig(workers, 1, 1), jax.devices()[:workers])
        self.traces = 0
        with jax.set_mesh(self.mesh):
            state = tx.init(params)
        full_specs = opt_state_specs(state, params, None, self.mesh)
        # Placed as the step returns them, so a step's inputs never change type between calls.
        self.state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(self.mesh, s), full_specs))
        self.params = jax.device_put(params, NamedSharding(self.mesh, P()))
        self.specs = manual_part(full_specs, {"data"})

        def per_shard(params, state, grads, stage):
            self.traces += 1
            local = jax.tree.map(lambda g: g[0], grads)
            updates, state = tx.update(local, state, params, **({} if stage is None else {"compression_stage": stage}))
            return optax.apply_updates(params, updates), state

        def step(params, state, grads, stage):
            return jax.shard_map(
                partial(per_shard, stage=stage), mesh=self.mesh, in_specs=(P(), self.specs, P("data")),
                out_specs=(P(), self.specs), axis_names={"data"}, check_vma=workers > 1,
            )(params, state, grads)

        self.eager = step
        self.jitted = jax.jit(step, static_argnums=3)

    def step(self, grads, stage: bool, *, jit=True):
        with jax.set_mesh(self.mesh):
            fn = self.jitted if jit else self.eager
            self.params, self.state = fn(self.params, self.state, grads, stage)
        return self.params, self.state


def random_params(rng, zero_bias=True):
    return {
        "blocks": rng.standard_normal((3, 6, 5)).astype(np.float32),
        "kernel": rng.standard_normal((7, 5)).astype(np.float32) * 0.5,
        "bias": np.zeros(5, np.float32) if zero_bias else rng.standard_normal(5).astype(np.float32),
    }


def random_grads(rng, params, workers, scale=1.0):
    """Non-IID local gradients: every worker has its own offset."""
    return {k: (rng.standard_normal((workers,) + v.shape) * scale + np.arange(workers).reshape((-1,) + (1,) * v.ndim)
                * 0.3).astype(np.float32) for k, v in params.items()}


def per_worker(grads, workers):
    return [{k: v[i] for k, v in grads.items()} for i in range(workers)]


def assert_tree_close(actual, expected, rtol=2e-4, atol=2e-6, what=""):
    for k in expected:
        np.testing.assert_allclose(np.asarray(actual[k]), expected[k], rtol=rtol, atol=atol, err_msg=f"{what}[{k}]")


def device_copies(array):
    return [np.asarray(shard.data) for shard in array.addressable_shards]


# ---------------------------------------------------------------------------------------------
# Against the numpy reference


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_every_step_matches_the_numpy_reference_and_replicas_agree(weight_decay):
    workers, freeze, steps, lr = 4, 3, 8, 0.02
    rng = np.random.default_rng(0)
    params = random_params(rng)
    decay = {"blocks": True, "kernel": True, "bias": False}
    tx = onebit_lamb(lr, freeze_step=freeze, weight_decay=weight_decay, mask=decay, stacked=stacked_flags)
    run = Harness(tx, params, workers)
    ref = NumpyOnebitLamb(params, workers, stacked=["blocks"], decay=["blocks", "kernel"], weight_decay=weight_decay)
    frozen_v = None
    for t in range(steps):
        grads = random_grads(rng, params, workers)
        compression = tx.compression_stage(t)
        p, s = run.step(grads, compression)
        ref.step(per_worker(grads, workers), compression, lr)
        what = f"step {t} ({'compression' if compression else 'warmup'})"
        assert_tree_close(p, ref.p, what=f"{what} params")
        assert_tree_close(s.mu, ref.m, what=f"{what} momentum")
        assert_tree_close(s.nu_fresh, ref.vf, what=f"{what} fresh variance")
        assert_tree_close(s.lamb_coeff, ref.c, what=f"{what} lamb coefficient")
        assert_tree_close(s.last_factor, ref.r, what=f"{what} factor")
        assert_tree_close(s.scaling, ref.s, what=f"{what} scaling")
        assert int(s.count) == t + 1
        if t == freeze - 1:  # v̂ = v when warmup ends
            for k in params:
                np.testing.assert_array_equal(np.asarray(s.nu_fresh[k]), np.asarray(s.nu[k]))
            frozen_v = jax.tree.map(np.asarray, s.nu)
            frozen_c = jax.tree.map(np.asarray, s.lamb_coeff)
        if compression:  # v and c frozen bit for bit; v̂ moves
            for k in params:
                np.testing.assert_array_equal(np.asarray(s.nu[k]), frozen_v[k])
                np.testing.assert_array_equal(np.asarray(s.lamb_coeff[k]), frozen_c[k])
                assert not np.array_equal(np.asarray(s.nu_fresh[k]), frozen_v[k])
        # Every device holds the same parameters and state; only the error buffers are its own.
        for tree in (p, s.mu, s.nu, s.nu_fresh, s.lamb_coeff, s.last_factor, s.scaling):
            for leaf in jax.tree.leaves(tree):
                copies = device_copies(leaf)
                assert all(np.array_equal(copies[0], c) for c in copies[1:]), what
        if compression:
            errors = device_copies(s.worker_error)
            assert len({e.tobytes() for e in errors}) == workers


def test_momentum_mask_zeroes_masked_entries_after_every_compression_step():
    workers, freeze, lr = 4, 2, 0.02
    rng = np.random.default_rng(1)
    params = random_params(rng, zero_bias=False)
    mask = {k: np.ones_like(v) for k, v in params.items()}
    mask["kernel"][4:] = 0  # e.g. position embeddings the sequence length never reaches
    tx = onebit_lamb(lr, freeze_step=freeze, momentum_mask=jax.tree.map(jnp.asarray, mask), stacked=stacked_flags)
    run = Harness(tx, params, workers)
    ref = NumpyOnebitLamb(params, workers, stacked=["blocks"], momentum_mask=mask)
    for t in range(6):
        grads = random_grads(rng, params, workers)
        _, s = run.step(grads, tx.compression_stage(t))
        ref.step(per_worker(grads, workers), tx.compression_stage(t), lr)
        assert_tree_close(s.mu, ref.m, what=f"step {t} momentum")
        if tx.compression_stage(t):
            assert (np.asarray(s.mu["kernel"])[4:] == 0).all()
            assert (np.asarray(s.mu["kernel"])[:4] != 0).all()


# ---------------------------------------------------------------------------------------------
# Warmup details


def test_zero_parameter_gets_ratio_one_and_leaves_the_ema_alone():
    params = {"bias": np.zeros(4, np.float32), "kernel": np.ones((4, 4), np.float32)}
    tx = onebit_lamb(0.1, freeze_step=5, stacked=stacked_flags)
    run = Harness(tx, params, 1)
    grads = {"bias": np.full((1, 4), 0.5, np.float32), "kernel": np.full((1, 4, 4), 0.5, np.float32)}
    p, s = run.step(grads, False)
    assert float(s.lamb_coeff["bias"]) == 0.0  # ratio undefined (zero weight norm): EMA skipped
    # ... and the update is lr · 1 · u with u = m / (sqrt(v) + eps) = 0.05 / sqrt(0.00025)
    np.testing.assert_allclose(np.asarray(p["bias"]), -0.1 * 0.05 / (np.sqrt(0.001 * 0.25) + 1e-8), rtol=1e-5)
    assert float(s.lamb_coeff["kernel"]) > 0


def test_ema_of_a_ratio_held_at_the_clip_bound():
    # Large weights, tiny updates: the ratio sits at max_coeff every step; a bound != 1 counts.
    params = {"kernel": np.full((8, 8), 100.0, np.float32)}
    tx = onebit_lamb(1e-6, freeze_step=10, max_coeff=0.3, coeff_beta=0.9)
    run = Harness(tx, params, 2)
    rng = np.random.default_rng(2)
    for n in range(1, 6):
        _, s = run.step({"kernel": rng.standard_normal((2, 8, 8)).astype(np.float32)}, False)
        np.testing.assert_allclose(float(s.lamb_coeff["kernel"]), 0.3 * (1 - 0.9 ** n), rtol=1e-6)


def test_scaling_coefficients_equalise_layer_rms_and_zero_momentum_gets_one():
    rng = np.random.default_rng(3)
    params = random_params(rng, zero_bias=False)
    tx = onebit_lamb(0.01, freeze_step=2, stacked=stacked_flags)
    run = Harness(tx, params, 2)
    for _ in range(2):
        grads = random_grads(rng, params, 2)
        grads["blocks"][:, 1] *= 30.0  # one layer with much larger momentum
        grads["bias"][:] = 0.0  # a parameter that never gets a gradient
        _, s = run.step(grads, False)
    scaled_rms = []
    for k in ("blocks", "kernel"):
        m, scale = np.asarray(s.mu[k]), np.asarray(s.scaling[k])
        rows = m.reshape(m.shape[0], -1) if k == "blocks" else m.reshape(1, -1)
        scaled_rms += list(np.sqrt((rows ** 2).mean(1)) * np.atleast_1d(scale))
    np.testing.assert_allclose(scaled_rms, scaled_rms[0], rtol=1e-5)
    assert float(s.scaling["bias"]) == 1.0 and np.isfinite(np.asarray(s.scaling["blocks"])).all()


# ---------------------------------------------------------------------------------------------
# Compression stage details


def test_one_worker_reconstructs_the_gradient_and_the_first_factor():
    # With P = 1 nothing is compressed: ĝ is the gradient, v̂ follows LAMB's recurrence, and with
    # the bounds out of the way the factor is max((sqrt(v_F)+eps)/(sqrt(v̂)+eps)), blended by wd.
    b2, eps, wd, lr = 0.999, 1e-8, 0.05, 0.01
    rng = np.random.default_rng(4)
    params = {"kernel": rng.standard_normal((6, 6)).astype(np.float32)}
    tx = onebit_lamb(lr, freeze_step=2, b2=b2, eps=eps, weight_decay=wd, factor_max=1e6, factor_min=1e-6,
                     factor_threshold=1e6)
    run = Harness(tx, params, 1)
    for _ in range(2):
        run.step({"kernel": rng.standard_normal((1, 6, 6)).astype(np.float32)}, False)
    before = jax.tree.map(np.asarray, run.state)
    p_before = np.asarray(run.params["kernel"])
    g = rng.standard_normal((6, 6)).astype(np.float32) * 0.1
    _, s = run.step({"kernel": g[None]}, True)
    m, m_last = np.asarray(s.mu["kernel"]), before.mu["kernel"]
    np.testing.assert_allclose((m - 0.9 * m_last) / 0.1, g, atol=1e-5)
    v_fresh = b2 * before.nu["kernel"] + (1 - b2) * g.astype(np.float64) ** 2
    np.testing.assert_allclose(np.asarray(s.nu_fresh["kernel"]), v_fresh, rtol=1e-5)
    denom = np.sqrt(before.nu["kernel"]) + eps
    raw = np.max(denom / (np.sqrt(v_fresh) + eps))
    u_plain = m / denom
    u = u_plain + wd * p_before
    rho = min(1.0, np.linalg.norm(u_plain) / np.linalg.norm(u))
    np.testing.assert_allclose(float(s.last_factor["kernel"]), raw * rho + 1 - rho, rtol=1e-5)


def test_factor_bounds_absolute_first_then_relative():
    # b2 = 0.5 halves v̂ every compression step with a zero gradient, so the raw factor grows as
    # 2^(k/2); the clipped factor must grow by exactly (1 + threshold) per step until factor_max.
    params = {"kernel": np.ones((4, 4), np.float32)}
    tx = onebit_lamb(1e-3, freeze_step=3, b2=0.5, eps=0.0)
    run = Harness(tx, params, 1)
    for _ in range(3):
        run.step({"kernel": np.full((1, 4, 4), 2.0, np.float32)}, False)
    factors = []
    for _ in range(18):
        _, s = run.step({"kernel": np.zeros((1, 4, 4), np.float32)}, True)
        factors.append(float(s.last_factor["kernel"]))
    expected = np.minimum(1.1 ** np.arange(1, 19), 4.0)
    np.testing.assert_allclose(factors, expected, rtol=1e-5)


def test_factor_stays_within_its_bounds_on_random_inputs():
    workers = 4
    rng = np.random.default_rng(5)
    params = random_params(rng, zero_bias=False)
    tx = onebit_lamb(0.01, freeze_step=3, stacked=stacked_flags, weight_decay=0.01)
    run = Harness(tx, params, workers)
    last = None
    for t in range(20):
        scale = 1.0 if t < 3 else float(np.exp(rng.uniform(-3, 2)))  # gradients jump around
        _, s = run.step(random_grads(rng, params, workers, scale), tx.compression_stage(t))
        if tx.compression_stage(t):
            factors = np.concatenate([np.atleast_1d(np.asarray(x)) for x in jax.tree.leaves(s.last_factor)])
            assert ((factors >= 0.5 - 1e-7) & (factors <= 4.0 + 1e-7)).all()
            if last is not None:
                assert (np.abs(factors / last - 1) <= 0.1 + 1e-6).all()
            last = factors


# ---------------------------------------------------------------------------------------------
# The whole algorithm on a convex problem (reference test 23)


def logistic_problem(workers=4, n=512, d=256, seed=6):
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal(d)
    x = (rng.standard_normal((workers, n, d)) + np.linspace(-1, 1, workers)[:, None, None]) / np.sqrt(d)  # non-IID
    y = (x @ w_true + rng.standard_normal((workers, n)) > 0).astype(np.float32)
    return x.astype(np.float32), y


def logistic_loss(w, x, y):
    logits = x @ w["w"] + w["b"]
    return jnp.mean(jnp.logaddexp(0.0, logits) - y * logits)


def train_logistic(workers, steps=150, freeze_step=25, reset_errors=False):
    """1-bit LAMB on 4 non-IID shards; ``workers=1`` runs the same algorithm on the exact mean
    gradient (no compression: the "uncompressed LAMB with the same freeze schedule")."""
    x, y = logistic_problem()
    params = {"w": np.full(x.shape[-1], 0.1, np.float32), "b": np.zeros((), np.float32)}
    tx = onebit_lamb(optax.cosine_decay_schedule(0.05, steps, alpha=0.01), freeze_step=freeze_step)
    run = Harness(tx, params, workers)
    grad = jax.vmap(jax.grad(logistic_loss), in_axes=(None, 0, 0))
    for t in range(steps):
        g = grad(run.params, x, y)
        if workers == 1:
            g = jax.tree.map(lambda a: a.mean(0, keepdims=True), g)
        run.step(g, tx.compression_stage(t))
        if reset_errors:
            run.state = run.state._replace(worker_error=jnp.zeros_like(run.state.worker_error),
                                           server_error=jnp.zeros_like(run.state.server_error))
    return float(jnp.mean(jax.vmap(logistic_loss, in_axes=(None, 0, 0))(run.params, x, y)))


def test_convex_problem_converges_like_uncompressed_and_error_feedback_matters():
    exact = train_logistic(workers=1)
    onebit = train_logistic(workers=4)
    no_feedback = train_logistic(workers=4, reset_errors=True)
    assert abs(onebit - exact) / exact < 0.02, (onebit, exact)
    assert no_feedback > onebit * 1.01, (no_feedback, onebit)


# ---------------------------------------------------------------------------------------------
# Two compiled programs, jit and eager agree, misuse is named


@pytest.mark.slow
def test_stage_switch_compiles_each_stage_once_and_eager_agrees():
    rng = np.random.default_rng(7)
    params = random_params(rng, zero_bias=False)
    grads = [random_grads(rng, params, 2) for _ in range(6)]
    tx = onebit_lamb(0.01, freeze_step=3, stacked=stacked_flags)
    jitted, eager = Harness(tx, params, 2), Harness(tx, params, 2)
    for t, g in enumerate(grads):
        p_jit, _ = jitted.step(g, tx.compression_stage(t))
        if t == 3:  # the first compression step, op by op
            p_eager, _ = eager.step(g, tx.compression_stage(t), jit=False)
            assert_tree_close(p_eager, jax.tree.map(np.asarray, p_jit), rtol=1e-5, atol=1e-6, what=f"step {t}")
        else:
            eager.step(g, tx.compression_stage(t))
    assert jitted.traces == 2  # one trace per stage, no retrace at or after the switch


def test_misuse_gets_a_clear_error():
    params = {"kernel": np.ones((4, 4), np.float32)}
    tx = onebit_lamb(0.01, freeze_step=2)
    with pytest.raises(ValueError, match=r"no mesh axis 'data' is in scope; call init under `with jax.set_mesh"):
        tx.init(params)
    run = Harness(tx, params, 2)
    grads = {"kernel": np.ones((2, 4, 4), np.float32)}
    with pytest.raises(TypeError, match=r"needs compression_stage=<Python bool>: False for the first freeze_step=2"):
        run.step(grads, None)  # forgotten
    with pytest.raises(TypeError, match=r"pass it as a static argument of the jitted step"), jax.set_mesh(run.mesh):
        jax.jit(run.eager)(run.params, run.state, grads, True)  # traced
    with pytest.raises(ValueError, match=r"run it inside a shard_map that is manual over 'data'"), \
            jax.set_mesh(run.mesh):
        tx.update({"kernel": jnp.ones((4, 4))}, run.state, params, compression_stage=False)
    other = Harness(tx, {"kernel": np.ones((4, 12), np.float32)}, 2)
    other.state = run.state._replace(mu={"kernel": jnp.zeros((4, 12))}, nu={"kernel": jnp.zeros((4, 12))},
                                     nu_fresh={"kernel": jnp.zeros((4, 12))})
    with pytest.raises(ValueError, match=r"the error buffers hold 16 and 8 elements per device, but these parameters"):
        other.step({"kernel": np.ones((2, 4, 12), np.float32)}, True)
    with pytest.raises(ValueError, match=r"freeze_step: must be an integer >= 1"):
        onebit_lamb(0.01, freeze_step=0)
    with pytest.raises(ValueError, match=r"factor_min, factor_max: need 0 < factor_min <= factor_max"):
        onebit_lamb(0.01, freeze_step=5, factor_min=2.0, factor_max=1.0)
