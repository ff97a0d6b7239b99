"""The experts' grouped matmul (:mod:`meshtron.models.grouped_matmul`): ``jax.lax.ragged_dot`` itself on CPU,
a VJP that keeps ``jax.lax.ragged_dot``'s numbers whatever kernel it wraps, and, compiled for an H100 with
tokamax installed, tokamax's grouped GEMM in place of XLA's masked product over every expert.

The kernel's own numbers need a GPU (Mosaic GPU kernels do not run on a CPU); what is checked without
one is the wrapper around it -- with the reference kernel in the kernel's place -- and the compiled
program for the H100 target.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.models import grouped_matmul as gm

SIZES = np.array([3, 0, 5, 2], np.int32)  # an expert with no rows; 10 of 12 rows in groups


def operands(rows: int = 12, k: int = 8, n: int = 6, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(SIZES), k, n)), dtype)
    g = jnp.asarray(rng.standard_normal((rows, n)), dtype)
    return x, w, g


def values_and_grads(fn, x, w, g, sizes):
    y, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), x, w)
    return (y, *vjp(g))


def test_on_cpu_it_is_ragged_dot_bit_for_bit():
    x, w, g = operands(dtype=jnp.bfloat16)
    sizes = jnp.asarray(SIZES)
    assert gm.kernel_for(jax.devices()[0]) == "xla"
    got = jax.jit(lambda a, b, c: values_and_grads(gm.grouped_matmul, a, b, c, sizes))(x, w, g)
    want = jax.jit(lambda a, b, c: values_and_grads(jax.lax.ragged_dot, a, b, c, sizes))(x, w, g)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_only_a_hopper_gpu_with_tokamax_gets_the_kernel(monkeypatch):
    class Device:
        def __init__(self, platform, capability=None):
            self.platform, self.compute_capability = platform, capability

    monkeypatch.setattr(gm, "_tokamax", lambda: object())
    assert [gm.kernel_for(Device(*d)) for d in [("gpu", "9.0"), ("gpu", "8.0"), ("gpu", "10.0"), ("cpu",)]] == [
        "tokamax", "xla", "xla", "xla"]
    monkeypatch.setattr(gm, "_tokamax", lambda: None)
    assert gm.kernel_for(Device("gpu", "9.0")) == "xla"


def leaves_unwritten(product, rows: bool):
    """``product`` as a kernel that writes nothing outside its groups may leave it: NaN in the rows past
    the groups (``rows``), or in the gradient of an expert with no rows."""
    def kernel(lhs, rhs, sizes):
        y = product(lhs, rhs, sizes)
        if rows:
            return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(sizes))[:, None], y, jnp.nan)
        return jnp.where((sizes > 0)[:, None, None], y, jnp.nan)
    return kernel


def test_the_kernels_vjp_gives_ragged_dots_values_and_gradients():
    """Rows past the groups and the expert with no rows come out zero even from a kernel that leaves them
    unwritten; the rest equals ``jax.lax.ragged_dot`` and its gradients."""
    x, w, g = operands()
    sizes = jnp.asarray(SIZES)
    weight_gradient = functools.partial(jax.lax.ragged_dot_general, ragged_dot_dimension_numbers=gm._WEIGHT_GRADIENT)

    def wrapped(a, b, s):
        return gm._kernel_grouped_matmul(a, b, s, leaves_unwritten(jax.lax.ragged_dot, rows=True),
                                         leaves_unwritten(weight_gradient, rows=False))

    got = values_and_grads(wrapped, x, w, g, sizes)
    want = values_and_grads(jax.lax.ragged_dot, x, w, g, sizes)
    for a, b in zip(got, want):
        assert not np.isnan(np.asarray(a)).any()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[2][1]).any()  # the expert with no rows: no gradient


# -- compiled for an H100 (compile-only: JAX's CUDA plugin; tokamax for the kernel) -------------------------

E, ROWS, K, N = 8, 640, 256, 128  # distinct sizes: a masked [E, rows, .] operand cannot pass for a weight
KERNEL = "mosaic_gpu_v2"


def compiled_for_h100(devices: int, gradient: bool):
    """``grouped_matmul`` (or its gradient) compiled for ``devices`` compile-only H100s under
    ``jax.set_mesh``, inside a ``shard_map`` splitting the rows when there are two or more."""
    from meshtron.gpu.targets import target_devices

    mesh = jax.sharding.Mesh(target_devices("h100", devices), ("rows",))
    P = jax.sharding.PartitionSpec
    whole = jax.sharding.NamedSharding(mesh, P())
    args = (jax.ShapeDtypeStruct((ROWS, K), jnp.bfloat16, sharding=whole),
            jax.ShapeDtypeStruct((E, K, N), jnp.bfloat16, sharding=whole),
            jax.ShapeDtypeStruct((E,), jnp.int32, sharding=whole))
    def fn(x, w, s):  # a function of its own: jit's cache would give one test's trace to the next
        return gm.grouped_matmul(x, w, s)

    if devices > 1:
        fn = jax.shard_map(fn, mesh=mesh, in_specs=(P("rows"), P(), P()), out_specs=P("rows"))
    if gradient:
        product = fn
        fn = jax.grad(lambda x, w, s: jnp.sum(product(x, w, s).astype(jnp.float32) ** 2), argnums=(0, 1))
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*args).compile()


def needs_h100_compiler_and_tokamax():
    from meshtron.gpu.targets import prepare_environment

    prepare_environment()
    pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for an H100 needs JAX's CUDA plugin "
                        "(the gpu-compile extra)")
    if gm._tokamax() is None:
        pytest.skip("tokamax (the gpu extra, Python 3.12) is not installed: the experts use jax.lax.ragged_dot")


@pytest.mark.gpu_compile
@pytest.mark.parametrize(("devices", "gradient", "kernels"), [(1, False, 1), (1, True, 3), (2, True, 3)],
                         ids=["forward", "forward-backward", "shard_map-forward-backward"])
def test_for_an_h100_the_product_is_the_kernel_and_no_gemm_over_every_expert(devices, gradient, kernels):
    """One kernel call per product (forward; backward's two), and no XLA GEMM left: XLA's ragged_dot
    would be ``E`` times the grouped product's FLOPs in ``[E, rows, ·]`` masked GEMMs."""
    from meshtron.hlo.gemms import gemms

    needs_h100_compiler_and_tokamax()
    compiled = compiled_for_h100(devices, gradient)
    text = compiled.as_text()
    assert re.findall(r'custom_call_target="([^"]+)"', text).count(KERNEL) == kernels
    assert gemms(compiled) == []
    assert not re.search(rf"\[{E},{ROWS // devices},\d+\]", text)  # no operand masked per expert
    if devices > 1:  # the replicated weight's gradient is summed over the row shards
        assert "all-reduce" in text


@pytest.mark.gpu_compile
def test_for_an_h100_xlas_ragged_dot_is_a_gemm_over_every_expert(monkeypatch):
    """What the kernel replaces: without tokamax, the H100 program multiplies every row by every expert."""
    from meshtron.gpu.targets import prepare_environment
    from meshtron.hlo.gemms import gemms

    prepare_environment()
    pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for an H100 needs JAX's CUDA plugin "
                        "(the gpu-compile extra)")
    monkeypatch.setattr(gm, "_tokamax", lambda: None)
    compiled = compiled_for_h100(1, gradient=False)
    assert sum(g.total_flops for g in gemms(compiled)) == E * 2 * ROWS * K * N


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize(("tensor", "kernels"), [(1, 9), (2, 0)], ids=["data8", "data4-tensor2"])
def test_an_h100_moe_train_step_runs_its_experts_in_the_kernel(tensor, kernels):
    """A bf16 Mixtral layer's three expert products, forward and backward, are the kernel's nine calls when
    the train step's ``shard_map`` leaves no axis of more than one device automatic; with the tensor axis
    automatic the products stay XLA's, which the partitioner splits over it."""
    from meshtron.config import load_config
    from meshtron.train.loop import Trainer

    needs_h100_compiler_and_tokamax()
    cfg = load_config("mixtral_cpu8", ["model.dtype=bfloat16", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
                                       "model.mlp_dim=128", "model.seq_len=64", "model.layers=1", "model.moe.mlp_dim=64",
                                       f"parallel.data={8 // tensor}", "parallel.pipe=1", f"parallel.tensor={tensor}",
                                       "parallel.microbatches=1", "train.batch_size=16"])
    trainer = Trainer.from_config(cfg, target="h100", read_data=False)
    text = trainer.steps.compile(*trainer.abstract_step_arguments(), trainer.steps.stages[0]).as_text()
    assert re.findall(r'custom_call_target="([^"]+)"', text).count(KERNEL) == kernels
