"""Expert-parallel dispatch (``model.moe.dispatch``): the ragged exchange's plans put every row where
``jax.lax.ragged_all_to_all``'s semantics say, grouped by expert on arrival and back where it left; the
CPU emulation of the primitive gives the documented example's result; ``ragged`` trains with the same
losses, gradients and weights as ``padded``; bad settings are one line; and the H100 program holds
real ragged all-to-alls whose send buffers are the routed rows, ordered against every other
collective in a pipeline, and ``ragged_dot`` as a masked dense product."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshtron.config import ConfigError, load_config
from meshtron.hlo.collectives import ragged_all_to_alls
from meshtron.models.moe import MoEDims, all_to_all_bytes
from meshtron.models.ragged_exchange import RaggedPlan, emulated_ragged_all_to_all, expert_plans
from meshtron.run import check_features


def reference_ragged_all_to_all(operands, outputs, plans):
    """``jax.lax.ragged_all_to_all`` on ``n`` devices in numpy, as its docstring's pseudocode states it:
    slice ``i`` of device ``s`` goes to device ``i // (K/n)``, written at ``output_offsets[i]``."""
    n = len(operands)
    results = [np.array(o, copy=True) for o in outputs]
    for s, plan in enumerate(plans):
        per = len(plan.send_sizes) // n
        for i in range(len(plan.send_sizes)):
            start, size, at = int(plan.input_offsets[i]), int(plan.send_sizes[i]), int(plan.output_offsets[i])
            results[i // per][at:at + size] = operands[s][start:start + size]
    return results


@pytest.mark.parametrize("n, local", [(4, 2), (8, 1), (2, 3)])
def test_plans_group_rows_by_expert_on_arrival_and_return_them_where_they_left(n, local):
    rng = np.random.default_rng(n * 10 + local)
    experts = n * local
    counts = rng.integers(0, 6, size=(n, experts)).astype(np.int32)
    counts[0, :] = 0  # a device that routes nothing
    counts[:, 1] = 0  # an expert nobody routes to
    plans = [expert_plans(jnp.asarray(counts), jnp.int32(r), local) for r in range(n)]
    # each device's rows sorted by expert, tagged (source, expert, index within that slice)
    sent = [np.array([(s, e, j) for e in range(experts) for j in range(counts[s, e])], np.int64).reshape(-1, 3)
            for s in range(n)]
    size = int(counts.reshape(n, n, local).sum((0, 2)).max())
    arrived = reference_ragged_all_to_all(sent, [np.full((size, 3), -1)] * n, [p.dispatch for p in plans])
    for r, plan in enumerate(plans):
        # the receiver's rows: its experts in order, each expert's rows source by source, nothing else
        want = [(s, e, j) for e in range(r * local, (r + 1) * local) for s in range(n) for j in range(counts[s, e])]
        np.testing.assert_array_equal(arrived[r][:len(want)], np.array(want).reshape(-1, 3))
        assert (arrived[r][len(want):] == -1).all()
        np.testing.assert_array_equal(plan.group_sizes, counts[:, r * local:(r + 1) * local].sum(0))
        # recv_sizes as the primitive requires: send_sizes == all_to_all(recv_sizes)
        for direction in ("dispatch", "combine"):
            sends = np.stack([np.asarray(getattr(p, direction).send_sizes).reshape(n, -1) for p in plans])
            recvs = np.stack([np.asarray(getattr(p, direction).recv_sizes).reshape(n, -1) for p in plans])
            np.testing.assert_array_equal(sends, recvs.transpose(1, 0, 2))
    back = reference_ragged_all_to_all(arrived, [np.full_like(x, -1) for x in sent], [p.combine for p in plans])
    for s in range(n):
        np.testing.assert_array_equal(back[s], sent[s])


def test_emulation_gives_the_documented_example():
    # jax.lax.ragged_all_to_all's docstring example on an axis of two devices
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    operand = jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32)
    plan = RaggedPlan(jnp.array([[0, 1], [0, 1]]), jnp.array([[1, 2], [1, 1]]), jnp.array([[0, 0], [1, 2]]),
                      jnp.array([[1, 1], [2, 1]]))

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    def run(operand, plan):
        plan = RaggedPlan(*(x[0] for x in plan))
        return emulated_ragged_all_to_all(operand[0], jnp.zeros(4, operand.dtype) + operand[0, :0].sum(), plan, "x",
                                          block=2)[None]

    split = jax.sharding.NamedSharding(mesh, P("x"))
    got = run(jax.device_put(operand, split), jax.device_put(plan, split))
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


# ---- training -----------------------------------------------------------------------------------------

MIXTRAL = ["model.family=llama", "model.layers=2", "model.hidden=32", "model.heads=4", "model.kv_heads=2",
           "model.mlp_dim=64", "model.seq_len=16", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp_dim=16",
           "model.moe.z_loss_weight=0.001", "train.batch_size=16", "train.warmup_steps=2", "train.eval_every=1000",
           "train.eval_batches=1", "train.steps=2"]


def trainer(dispatch, *overrides):
    from meshtron.train.loop import Trainer

    return Trainer.from_config(load_config(None, [*MIXTRAL, *overrides, f"model.moe.dispatch={dispatch}"]))


@pytest.mark.parametrize("layout", [
    ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2"],
    pytest.param(["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1"], marks=[pytest.mark.slow,
                                                                                   pytest.mark.extended]),
    pytest.param(["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=1f1b",
                  "parallel.microbatches=4", "model.remat=full"], marks=pytest.mark.slow),
], ids=["data4-tensor2", "data8", "1f1b-remat"])
def test_ragged_dispatch_gives_the_loss_and_gradients_of_padded(layout):
    padded, ragged = trainer("padded", *layout), trainer("ragged", *layout)
    params = padded.init_params()
    tokens = jax.random.randint(jax.random.key(1), (16, 17), 0, padded.cfg.model.vocab_size, jnp.int32)
    loss_p, grads_p = padded.steps.gradients(params, jax.device_put(tokens, padded.steps.batch_sharding))
    loss_r, grads_r = ragged.steps.gradients(params, jax.device_put(tokens, ragged.steps.batch_sharding))
    assert float(loss_r) == pytest.approx(float(loss_p), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 jax.device_get(grads_r), jax.device_get(grads_p))


@pytest.mark.slow
def test_ragged_dispatch_trains_two_steps_like_padded():
    layout = ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2"]
    first, second = trainer("padded", *layout).run(), trainer("ragged", *layout).run()
    np.testing.assert_allclose(second.losses, first.losses, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(second.params), jax.device_get(first.params))


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.dispatch=sparse"], r"^model.moe.dispatch: must be padded or ragged, got 'sparse'$"),
    (["model.moe.dispatch=ragged", "model.moe.capacity_factor=1.25"],
     (r"^model.moe.dispatch: ragged sends each expert its routed rows, so it needs dropless experts; set "
      r"model.moe.capacity_factor=0 \(got 1.25\) or model.moe.dispatch=padded$")),
])
def test_bad_dispatch_settings_are_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_features(load_config(None, [*MIXTRAL, *overrides]))


def test_ragged_all_to_all_bytes_are_the_routed_rows():
    # 8 experts top-2 over 8 devices, 128 tokens: padded sends each destination a 128-row block
    # (n · T · min(k, E/n) = 1024 rows), ragged the 256 routed rows, 7/8 of them leaving when balanced
    padded = MoEDims(hidden=64, experts=8, top_k=2, mlp_dim=64)
    ragged = MoEDims(hidden=64, experts=8, top_k=2, mlp_dim=64, dispatch="ragged")
    rows = 7 / 8 * 4 * 256 * 64 * 4
    assert all_to_all_bytes(ragged, 128, 8) == pytest.approx(rows + 7 * 8 * 4 + 7 / 8 * 4 * 8 * 4)
    assert all_to_all_bytes(padded, 128, 8) == pytest.approx(7 / 8 * (4 * 1024 * 64 * 4 + 1024 * 4))


def test_describe_says_the_ragged_exchange_is_the_routed_rows_and_does_not_compare_it_with_the_program():
    from meshtron.describe import ExpertExchange
    from meshtron.units import format_bytes

    dims = MoEDims(hidden=64, experts=8, top_k=2, mlp_dim=64, dispatch="ragged")
    exchange = ExpertExchange("data", 8, 8, 128, 1, 2, 2, all_to_all_bytes(dims, 128, 8), "ragged")
    assert exchange.line().startswith("split over data (8 ranks, 1 expert each): ragged all-to-all of the routed rows "
                                      f"(balanced routing) {format_bytes(all_to_all_bytes(dims, 128, 8))} per device")
    assert exchange.measured([]).startswith("ragged all-to-all over data: its sizes are the routing's")


_RACING_RAGGED_EXCHANGE = """HloModule m

%work (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  %o = f32[4] constant({0, 0, 0, 0})
  %i = s64[2] constant({0, 0})
  ROOT %r = f32[4] ragged-all-to-all(f32[4] %p, f32[4] %o, s64[2] %i, s64[2] %i, s64[2] %i, s64[2] %i), channel_id=2, replica_groups={{0,1}}
}

%idle (q: f32[4]) -> f32[4] {
  ROOT %q = f32[4] parameter(0)
}

ENTRY %main (x: f32[4], pred: pred[]) -> (f32[4], f32[4]) {
  %x = f32[4] parameter(0)
  %pred = pred[] parameter(1)
  %cond = f32[4] conditional(pred[] %pred, f32[4] %x, f32[4] %x), true_computation=%work, false_computation=%idle
  %send = f32[4] collective-permute(f32[4] %x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %out = (f32[4], f32[4]) tuple(f32[4] %cond, f32[4] %send)
}
"""


def test_the_ordering_check_sees_a_ragged_exchange_in_a_conditional():
    from meshtron.hlo.order import unordered_collectives

    [pair] = unordered_collectives(_RACING_RAGGED_EXCHANGE)
    assert {pair.first, pair.second} == {"cond", "send"}


# ---- the H100 program ---------------------------------------------------------------------------------

_DEFINED = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = \(*\w+\[(\d+)", re.MULTILINE)


def ragged_exchanges(text: str) -> list[tuple[int, int]]:
    """(operand rows, output rows) of each ragged all-to-all of a scheduled XLA:GPU program: a
    synchronous one's result is its output, its first argument its operand; an asynchronous start
    lists both first."""
    rows = {name: int(size) for name, size in _DEFINED.findall(text)}
    found = []
    for line in text.splitlines():
        if " ragged-all-to-all(" in line:
            result, operand = line.split(" ragged-all-to-all(", 1)
            found.append((rows[operand.split(",", 1)[0]], int(re.search(r"\[(\d+),", result).group(1))))
        elif " ragged-all-to-all-start(" in line:
            shapes = re.findall(r"\w+\[(\d+),\d+\]", line.split(" ragged-all-to-all-start(", 1)[0])
            found.append((int(shapes[0]), int(shapes[1])))
    return found


def row_all_to_alls(text: str) -> list[str]:
    """The plain all-to-alls of floating-point rows (the padded exchange's)."""
    return [line for line in text.splitlines()
            if re.search(r" all-to-all(-start)?\(", line) and re.search(r"f32\[\d+,\d+\]", line.split(" all-to-all", 1)[0])]


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_h100_step_sends_the_routed_rows_with_ragged_all_to_alls(gpu_target):
    from meshtron.train.loop import Trainer

    # 8 experts top-2 over data=8, one layer, 128 tokens per device: T·k = 256 routed rows, and the
    # receive buffer holds the worst case n · T · min(k, E/n) = 1024
    cfg = load_config("mixtral_cpu8", ["model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.mlp_dim=128",
                                       "model.seq_len=64", "model.vocab_size=256", "model.layers=1",
                                       "model.moe.mlp_dim=64", "model.moe.dispatch=ragged", "parallel.data=8",
                                       "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1",
                                       "train.batch_size=16", "train.steps=10", "train.warmup_steps=1"])
    tr = Trainer.from_config(cfg, target=gpu_target, read_data=False)
    params, opt_state, tokens = tr.abstract_step_arguments()
    text = tr.steps.compile(params, opt_state, tokens, tr.steps.stages[0]).as_text()
    exchanges = ragged_exchanges(text)
    # dispatch and combine forward, their transposes backward: the routed rows into the worst case and back
    assert sorted(exchanges) == [(256, 1024), (256, 1024), (1024, 256), (1024, 256)]
    assert not row_all_to_alls(text)  # no padded exchange left: only the small int32 bookkeeping
    # read back onto the mesh: over data, once each; balanced, each trip sends its 256 routed rows of 64
    # floats, 7/8 of them to other devices
    found, row = ragged_all_to_alls(text, tr.mesh), 64 * 4
    assert sorted((c.bytes // row, c.receive_bytes // row) for c in found) == [(256, 1024)] * 2 + [(1024, 256)] * 2
    assert all(c.axes == ("data",) and c.group_size == 8 and c.count == 1 for c in found)
    assert sum(c.total_wire_bytes for c in found) == pytest.approx(4 * 7 / 8 * 256 * row)


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_h100_ragged_dot_is_a_masked_dense_product(gpu_target):
    from meshtron.gpu.targets import target_devices

    device = target_devices(gpu_target, 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    rows, width, out, groups = 512, 256, 384, 8
    args = (jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((groups, width, out), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=sharding))
    text = jax.jit(jax.lax.ragged_dot).lower(*args).compile().as_text()
    # every group's matrix multiplies every row (rows outside its group selected to zero), then a sum
    assert re.search(rf"f32\[{groups},{rows},{out}\]\S* fusion\([^)]*\), kind=kCustom, calls=%\S*gemm_fusion", text)
    assert re.search(rf"bf16\[{groups},{rows},{width}\]\S* fusion\([^)]*\), kind=kLoop, calls=%fused_select", text)
    assert "ragged-dot" not in text and "custom_call_target" not in text


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_h100_pipelined_ragged_step_orders_every_collective(gpu_target):
    from meshtron.hlo.order import unordered_collectives
    from meshtron.train.loop import Trainer

    # 1F1B on (2,2,2) with every layer recomputed: ragged exchanges inside the stages' conditionals,
    # forward, recomputed and transposed, each ordered against every other collective
    cfg = load_config("mixtral_cpu8", ["model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.mlp_dim=128",
                                       "model.seq_len=64", "model.vocab_size=256", "model.layers=2",
                                       "model.moe.mlp_dim=64", "model.moe.dispatch=ragged", "model.remat=full",
                                       "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                                       "parallel.microbatches=4", "parallel.schedule=1f1b", "parallel.chunks=1",
                                       "train.batch_size=16", "train.steps=10", "train.warmup_steps=1"])
    tr = Trainer.from_config(cfg, target=gpu_target, read_data=False)
    params, opt_state, tokens = tr.abstract_step_arguments()
    compiled = tr.steps.compile(params, opt_state, tokens, tr.steps.stages[0])
    assert len(ragged_exchanges(compiled.as_text())) >= 6  # dispatch and combine: forward, recomputed, transposed
    assert unordered_collectives(compiled) == []
