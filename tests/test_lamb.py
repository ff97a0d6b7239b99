"""Layerwise LAMB: a stacked [layers, ...] leaf gets the trust ratio each layer would get on its own."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshtron.optim.lamb import layerwise_lamb
from meshtron.optim.masks import decay_from_axes, stacked_from_axes


def test_stacked_leaf_matches_optax_lamb_per_layer():
    rng = np.random.default_rng(0)
    layers = [jnp.asarray(rng.standard_normal((4, 3)) * (i + 1), jnp.float32) for i in range(3)]
    grads = [jnp.asarray(rng.standard_normal((4, 3)) * 10 ** -i, jnp.float32) for i in range(3)]
    stacked = {"blocks": {"w": jnp.stack(layers)}, "wte": layers[0] * 2}
    stacked_grads = {"blocks": {"w": jnp.stack(grads)}, "wte": grads[0]}
    axes = {"blocks": {"w": ("layers", "embed", "mlp")}, "wte": ("embed", "mlp")}
    tx = layerwise_lamb(1e-2, weight_decay=0.1, stacked=stacked_from_axes(axes))
    state = tx.init(stacked)
    for _ in range(3):  # a few steps so the moments matter
        updates, state = tx.update(stacked_grads, state, stacked)
        stacked = optax.apply_updates(stacked, updates)

    # The same with optax.lamb on each layer as its own leaf.
    separate = {f"layer{i}": w for i, w in enumerate(layers)} | {"wte": layers[0] * 2}
    separate_grads = {f"layer{i}": g for i, g in enumerate(grads)} | {"wte": grads[0]}
    ref = optax.lamb(1e-2, weight_decay=0.1)
    ref_state = ref.init(separate)
    for _ in range(3):
        updates, ref_state = ref.update(separate_grads, ref_state, separate)
        separate = optax.apply_updates(separate, updates)

    for i in range(3):
        np.testing.assert_allclose(stacked["blocks"]["w"][i], separate[f"layer{i}"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(stacked["wte"], separate["wte"], rtol=1e-6, atol=1e-7)
    # And it differs from treating the stack as one layer, which is what plain optax.lamb would do.
    whole = optax.lamb(1e-2, weight_decay=0.1)
    p = {"blocks": {"w": jnp.stack(layers)}, "wte": layers[0] * 2}
    whole_state = whole.init(p)
    for _ in range(3):
        updates, whole_state = whole.update(stacked_grads, whole_state, p)
        p = optax.apply_updates(p, updates)
    assert not np.allclose(jax.device_get(p["blocks"]["w"][2]), separate["layer2"], rtol=1e-4)


def test_optimizer_choices_come_from_logical_axes_not_names():
    """Per-layer trust ratios where the first axis is ``layers``; decay on ``embed`` x another axis.
    For the GPT that is exactly Megatron's choice (kernels and embeddings, not biases or norms)."""
    from meshtron.config import ModelConfig
    from meshtron.train.state import model_def_from_config
    from meshtron.trees import leaf_names

    md = model_def_from_config(ModelConfig(), 1)
    names = leaf_names(md.shapes())
    decay = dict(zip(names, jax.tree.leaves(decay_from_axes(md.logical_axes())), strict=True))
    stacked = dict(zip(names, jax.tree.leaves(stacked_from_axes(md.logical_axes())), strict=True))
    assert {n for n, d in decay.items() if d} == {n for n in names if n.split(".")[-1] in ("kernel", "wte", "wpe")}
    assert {n for n, s in stacked.items() if s} == {n for n in names if n.startswith("blocks.")}
    # A model with other names gets the same choices from the same axes.
    axes = {"trunk": {"w_in": ("layers", "embed", "ffn"), "gain": ("layers", "embed"), "b": ("layers", "ffn")},
            "tok": ("vocab", "embed"), "out_bias": ("vocab",)}
    assert decay_from_axes(axes) == {"trunk": {"w_in": True, "gain": False, "b": False}, "tok": True, "out_bias": False}
    assert stacked_from_axes(axes) == {"trunk": {"w_in": True, "gain": True, "b": True}, "tok": False, "out_bias": False}
