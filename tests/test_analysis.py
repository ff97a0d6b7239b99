"""meshtron.hlo (collectives read from compiled HLO), meshtron.megatron (Megatron's analytical
figures) and meshtron.units.

The compiled-program tests run tiny shard_map / jit programs on the 8 simulated CPU devices that
``conftest.py`` sets up, and check the parser against numbers worked out by hand: which mesh axes a
collective spans, its per-device result bytes, and how many times loops make it run. Hand-written
HLO snippets cover the forms the CPU backend does not print (iota groups, async start/done pairs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.hlo.collectives import (
    Collective,
    bytes_by_axes,
    collectives,
    count_by,
    iota_device_groups,
    ring_wire_bytes,
)
from meshtron.hlo.summary import analyze
from meshtron.hlo.text import ArrayShape, parse_shape
from meshtron.megatron import megatron_figures
from meshtron.units import format_bytes


def make_mesh(data: int, pipe: int, tensor: int) -> jax.sharding.Mesh:
    return jax.make_mesh((data, pipe, tensor), ("data", "pipe", "tensor"), axis_types=(AxisType.Auto,) * 3)


def compile_shard_map(fn, mesh, in_specs, out_specs, *args, check_vma: bool = True):
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    return jax.jit(mapped).lower(*args).compile()


# --------------------------------------------------------------------------------------------------
# Compiled programs on 8 simulated devices
# --------------------------------------------------------------------------------------------------


def test_psum_over_tensor_is_one_all_reduce_of_the_local_array():
    mesh = make_mesh(2, 1, 4)
    compiled = compile_shard_map(lambda x: lax.psum(x, "tensor"), mesh, P(), P(), jnp.ones((4, 8)))

    [coll] = collectives(compiled, mesh)

    assert (coll.kind, coll.axes, coll.dtype) == ("all-reduce", ("tensor",), "f32")
    assert coll.bytes == 4 * 8 * 4
    assert coll.count == 1 and coll.total_bytes == 128
    assert coll.group_size == 4
    assert not coll.unknown_trip_count
    assert coll.wire_bytes == pytest.approx(2 * 3 / 4 * 128)


def test_hlo_text_and_axis_size_dict_give_the_same_answer_as_compiled_and_mesh():
    mesh = make_mesh(2, 1, 4)
    compiled = compile_shard_map(lambda x: lax.psum(x, "tensor"), mesh, P(), P(), jnp.ones((4, 8)))

    from_text = collectives(compiled.as_text(), {"data": 2, "pipe": 1, "tensor": 4})

    assert from_text == collectives(compiled, mesh)


def test_fori_loop_multiplies_the_count_by_its_trip_count():
    mesh = make_mesh(2, 1, 4)

    def five_psums(x):
        return lax.fori_loop(0, 5, lambda i, c: lax.psum(c, "tensor") * 0.5, x)

    [coll] = collectives(compile_shard_map(five_psums, mesh, P(), P(), jnp.ones((4, 8))), mesh)

    assert (coll.kind, coll.axes, coll.count) == ("all-reduce", ("tensor",), 5)
    assert coll.total_bytes == 5 * 128


def test_scan_multiplies_the_count_by_its_length():
    mesh = make_mesh(2, 1, 4)

    def scanned(x):
        carry, _ = lax.scan(lambda c, _: (lax.psum(c, "tensor") * 0.5, None), x, None, length=5)
        return carry

    [coll] = collectives(compile_shard_map(scanned, mesh, P(), P(), jnp.ones((4, 8))), mesh)

    assert coll.count == 5


def test_nested_loops_multiply():
    mesh = make_mesh(2, 1, 4)

    def nested(x):
        inner = lambda i, c: lax.psum(c, "tensor") * 0.5
        return lax.fori_loop(0, 3, lambda i, c: lax.fori_loop(0, 5, inner, c), x)

    [coll] = collectives(compile_shard_map(nested, mesh, P(), P(), jnp.ones((4, 8))), mesh)

    assert coll.count == 15
    assert coll.total_bytes == 15 * 128


def test_many_psums_in_a_loop_keep_their_bytes_whether_or_not_xla_combines_them():
    """Seven psums per iteration: XLA may fuse them into one tuple-shaped all-reduce (the loop
    carry is then a tuple long enough to get ``/*index=5*/`` comments); bytes must not change."""
    mesh = make_mesh(2, 1, 4)
    arrays = [jnp.ones((4, width)) for width in range(1, 8)]

    def seven_psums(*carry):
        body = lambda i, c: tuple(lax.psum(x, "tensor") * 0.5 + i for x in c)
        return lax.fori_loop(0, 5, body, carry)

    compiled = compile_shard_map(seven_psums, mesh, (P(),) * 7, (P(),) * 7, *arrays)
    colls = collectives(compiled, mesh)

    assert {(c.kind, c.axes, c.count) for c in colls} == {("all-reduce", ("tensor",), 5)}
    assert bytes_by_axes(colls) == {("tensor",): 5 * 4 * sum(range(1, 8)) * 4}


def test_ppermute_over_pipe_is_a_collective_permute_over_pipe():
    mesh = make_mesh(1, 4, 2)
    ring = [(i, (i + 1) % 4) for i in range(4)]
    compiled = compile_shard_map(
        lambda x: lax.ppermute(x, "pipe", ring), mesh, P("pipe"), P("pipe"), jnp.ones((8, 8))
    )

    [coll] = collectives(compiled, mesh)

    assert (coll.kind, coll.axes, coll.dtype) == ("collective-permute", ("pipe",), "f32")
    assert coll.bytes == 2 * 8 * 4  # the local [8/4, 8] block
    assert coll.group_size == 4
    assert coll.wire_bytes == coll.bytes


def test_all_gather_and_all_to_all_over_data_in_uint8():
    mesh = make_mesh(4, 1, 2)

    def gather_and_shuffle(x):  # local x: u8[4, 4]
        return lax.all_gather(x, "data"), lax.all_to_all(x, "data", 0, 0, tiled=True)

    compiled = compile_shard_map(
        gather_and_shuffle,
        mesh,
        P("data", "tensor"),
        (P(None, None, "tensor"), P("data", "tensor")),
        jnp.ones((16, 8), jnp.uint8),
        check_vma=False,
    )

    by_kind = {c.kind: c for c in collectives(compiled, mesh)}

    assert set(by_kind) == {"all-gather", "all-to-all"}
    gather, shuffle = by_kind["all-gather"], by_kind["all-to-all"]
    assert (gather.axes, gather.dtype, gather.group_size) == (("data",), "u8", 4)
    assert gather.bytes == 4 * 4 * 4  # gathered u8[4, 4, 4]
    assert gather.wire_bytes == pytest.approx(3 / 4 * 64)
    assert (shuffle.axes, shuffle.dtype, shuffle.group_size) == (("data",), "u8", 4)
    assert shuffle.bytes == 4 * 4  # same size out as in: u8[4, 4]


def test_psum_over_two_axes_spans_both_and_not_the_third():
    mesh = make_mesh(2, 2, 2)
    compiled = compile_shard_map(
        lambda x: lax.psum(x, ("data", "tensor")), mesh, P("data", "tensor"), P(), jnp.ones((4, 4))
    )

    [coll] = collectives(compiled, mesh)

    assert (coll.kind, coll.axes, coll.group_size) == ("all-reduce", ("data", "tensor"), 4)
    assert coll.bytes == 2 * 2 * 4


def test_gspmd_gradient_all_reduce_over_data_moves_the_local_parameter_bytes():
    """Sharding propagation (no shard_map) must still reduce gradients over data only: each device
    all-reduces exactly its tensor-parallel parameter shard."""
    mesh = make_mesh(2, 1, 4)

    def loss(w1, w2, x):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    shardings = (
        NamedSharding(mesh, P(None, "tensor")),  # column-parallel w1: [16, 32] -> [16, 8]
        NamedSharding(mesh, P("tensor", None)),  # row-parallel w2: [32, 16] -> [8, 16]
        NamedSharding(mesh, P("data", None)),
    )
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=shardings)
    compiled = grad.lower(jnp.ones((16, 32)), jnp.ones((32, 16)), jnp.ones((8, 16))).compile()

    step = analyze(compiled, mesh)
    local_param_bytes = (16 * 8 + 8 * 16) * 4

    assert step.bytes_by_axes() == {("data",): local_param_bytes}
    assert count_by(step.collectives, kind="all-reduce", axes="data") >= 1
    assert step.flops is not None and step.flops > 0
    assert step.memory is not None
    assert step.memory.argument_size_in_bytes == local_param_bytes + 4 * 16 * 4
    # Outputs are the two gradients plus the CPU backend's small tuple index table.
    assert local_param_bytes <= step.memory.output_size_in_bytes < local_param_bytes + 64
    table = step.table()
    assert "all-reduce" in table and "data" in table and "1.0 KiB" in table


# --------------------------------------------------------------------------------------------------
# Hand-written HLO: group forms, tuples, async pairs, call graph
# --------------------------------------------------------------------------------------------------

MESH_2_1_4 = {"data": 2, "pipe": 1, "tensor": 4}
MESH_2_2_2 = {"data": 2, "pipe": 2, "tensor": 2}


def one_op_module(instruction: str, operand: str = "f32[8]{0}") -> str:
    return f"""HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (p: {operand}) -> f32[8] {{
  %p = {operand} parameter(0)
  ROOT {instruction}
}}
"""


@pytest.mark.parametrize(
    ("groups", "mesh", "axes", "group_size"),
    [
        ("[2,4]<=[8]", MESH_2_1_4, ("tensor",), 4),
        ("[4,2]<=[2,4]T(1,0)", MESH_2_1_4, ("data",), 2),
        ("[2,4]<=[2,2,2]T(2,1,0)", MESH_2_2_2, ("data", "pipe"), 4),
        ("{{0,1},{2,3},{4,5},{6,7}}", MESH_2_2_2, ("tensor",), 2),
        ("{{0,2},{1,3},{4,6},{5,7}}", MESH_2_2_2, ("pipe",), 2),
        ("{{0,1,2,3,4,5,6,7}}", MESH_2_1_4, ("data", "tensor"), 8),
        ("{}", MESH_2_2_2, ("data", "pipe", "tensor"), 8),
    ],
)
def test_replica_group_forms_map_to_mesh_axes(groups, mesh, axes, group_size):
    hlo = one_op_module(
        f"%r = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
        "use_global_device_ids=true, to_apply=%add"
    )

    [coll] = collectives(hlo, mesh)

    assert (coll.axes, coll.group_size, coll.bytes) == (axes, group_size, 32)


def test_iota_groups_reshape_transpose_reshape():
    assert iota_device_groups(2, 4, [8]) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert iota_device_groups(4, 2, [2, 4], [1, 0]) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert iota_device_groups(2, 4, [2, 2, 2], [2, 1, 0]) == [(0, 4, 2, 6), (1, 5, 3, 7)]


def test_combined_tuple_all_reduce_sums_its_elements():
    hlo = one_op_module(
        "%r = (f32[8,16]{1,0}, bf16[4]{0}) all-reduce(%p, %p), channel_id=3, "
        "replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add"
    )

    [coll] = collectives(hlo, MESH_2_1_4)

    assert coll.bytes == 8 * 16 * 4 + 4 * 2
    assert coll.dtype == "f32+bf16"
    assert coll.axes == ("data",)


def test_long_tuples_with_index_comments_parse():
    six = ", ".join(["f32[2]{0}"] * 5) + ", /*index=5*/f32[2]{0}"
    hlo = one_op_module(
        f"%r = ({six}) all-reduce(%p, %p, %p, %p, %p, /*index=5*/%p), channel_id=1, "
        "replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add"
    )

    [coll] = collectives(hlo, MESH_2_1_4)

    assert (coll.bytes, coll.dtype, coll.axes) == (6 * 8, "f32", ("tensor",))


def test_source_target_pairs_give_the_axes_of_a_permute():
    hlo = one_op_module(
        "%r = f32[8]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,4},{4,0}}"
    )

    [coll] = collectives(hlo, MESH_2_2_2)

    assert (coll.kind, coll.axes, coll.bytes) == ("collective-permute", ("data",), 32)


def test_a_device_id_outside_the_mesh_is_an_error():
    hlo = one_op_module(
        "%r = f32[8]{0} all-reduce(%p), replica_groups={{0,8}}, use_global_device_ids=true, to_apply=%add"
    )
    with pytest.raises(ValueError, match="does not fit a mesh"):
        collectives(hlo, MESH_2_2_2)


ASYNC_HLO = """HloModule async, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_body (x: f32[16]) -> f32[4] {
  %x = f32[16]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%x), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[16], /*index=1*/q: (f32[4], (bf16[8], s32[]))) -> f32[4] {
  %p = f32[16]{0} parameter(0)
  %q = (f32[4]{0}, (bf16[8]{0}, s32[])) parameter(1)
  %ag-start = (f32[4]{0}, f32[16]{0}) all-gather-start(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %ag-done = f32[16]{0} all-gather-done(%ag-start)
  %ar-start = (f32[16]{0}, bf16[8]{0}) all-reduce-start(%p, %p), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ar-done = (f32[16]{0}, bf16[8]{0}) all-reduce-done(%ar-start)
  %cp-start = (bf16[8]{0}, bf16[8]{0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[8]{0} collective-permute-done(%cp-start)
  %rs-start = ((f32[16]{0}), f32[4]{0}, s32[]) async-start(%p), calls=%rs_body
  ROOT %rs-done = f32[4]{0} async-done(%rs-start), calls=%rs_body
}
"""


def test_async_pairs_count_the_start_once_with_its_data_shape():
    colls = {c.kind: c for c in collectives(ASYNC_HLO, MESH_2_1_4)}

    assert set(colls) == {"all-gather", "all-reduce", "collective-permute", "reduce-scatter"}
    assert (colls["all-gather"].bytes, colls["all-gather"].axes) == (64, ("tensor",))
    assert (colls["all-reduce"].bytes, colls["all-reduce"].axes) == (64 + 16, ("data",))
    assert (colls["collective-permute"].bytes, colls["collective-permute"].dtype) == (16, "bf16")
    assert colls["collective-permute"].axes == ("tensor",)
    reduce_scatter = colls["reduce-scatter"]
    assert (reduce_scatter.bytes, reduce_scatter.count, reduce_scatter.axes) == (16, 1, ("tensor",))
    assert reduce_scatter.wire_bytes == 3 * 16
    assert all(c.count == 1 for c in colls.values())


# XLA:GPU's own form (jax 0.12 with its CUDA plugin, a zero=1 step compiled for H100s): the gradients'
# reduce-scatter as one tuple pair, ``((operands), (results))``.
GPU_REDUCE_SCATTER_HLO = """HloModule gpu_async, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[128,16], q: f32[16]) -> (f32[64,16], f32[8]) {
  %p = f32[128,16]{1,0} parameter(0)
  %q = f32[16]{0} parameter(1)
  %reduce-scatter-start = ((f32[128,16]{1,0}, f32[16]{0}), (f32[64,16]{1,0}, f32[8]{0})) reduce-scatter-start(%p, %q), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, dimensions={0}, to_apply=%add, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
  ROOT %reduce-scatter-done = (f32[64,16]{1,0}, f32[8]{0}) reduce-scatter-done(%reduce-scatter-start)
}
"""


def test_a_gpu_reduce_scatter_pair_counts_its_start_with_the_scattered_shards():
    (reduce_scatter,) = collectives(GPU_REDUCE_SCATTER_HLO, MESH_2_1_4)

    assert (reduce_scatter.kind, reduce_scatter.axes, reduce_scatter.count) == ("reduce-scatter", ("data",), 1)
    assert reduce_scatter.bytes == (64 * 16 + 8) * 4


# XLA:GPU's asynchronous all-to-all (a mixture of experts' dispatch, compiled for H100s): ``((operands), result)``.
GPU_ALL_TO_ALL_HLO = """HloModule gpu_all_to_all, num_partitions=8

ENTRY %main (p: f32[512,64]) -> f32[512,64] {
  %p = f32[512,64]{1,0} parameter(0)
  %all-to-all-start = ((f32[512,64]{1,0}), f32[512,64]{1,0}) all-to-all-start(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  ROOT %all-to-all-done = f32[512,64]{1,0} all-to-all-done(%all-to-all-start)
}
"""


def test_a_gpu_all_to_all_pair_counts_its_start_once():
    (all_to_all,) = collectives(GPU_ALL_TO_ALL_HLO, MESH_2_1_4)

    assert (all_to_all.kind, all_to_all.axes, all_to_all.count) == ("all-to-all", ("data",), 1)
    assert all_to_all.bytes == 512 * 64 * 4


CALL_GRAPH_HLO = """HloModule loops, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%shared (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %shared_ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add, metadata={op_name="while/body=%fake"}
}

%inner_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %inner_ar = f32[8]{0} all-reduce(%v), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %inner_ar)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"5"}}
  %v = f32[8]{0} get-tuple-element(%w), index=1
  %c = f32[8]{0} call(%v), to_apply=%shared
  %i = s32[] get-tuple-element(%w), index=0
  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %c)
}

%dynamic_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %dyn_ag = f32[16]{0} all-gather(%v), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %v)
}

%branch_a (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %branch_ar = f32[8]{0} all-reduce(%x), channel_id=4, replica_groups={}, to_apply=%add
}

%branch_b (x: f32[8]) -> f32[8] {
  ROOT %x = f32[8]{0} parameter(0)
}

ENTRY %main (p: f32[8], k: s32[]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %k = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %p)
  %outer = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %dyn = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%dynamic_body
  %v = f32[8]{0} get-tuple-element(%outer), index=1
  %once = f32[8]{0} call(%v), to_apply=%shared
  ROOT %pick = f32[8]{0} conditional(%k, %v, %v), branch_computations={%branch_a, %branch_b}
}
"""


def test_call_graph_counts_multiply_through_loops_and_add_over_call_sites():
    colls = {c.name: c for c in collectives(CALL_GRAPH_HLO, MESH_2_1_4)}

    assert set(colls) == {"shared_ar", "inner_ar", "dyn_ag", "branch_ar"}
    assert colls["inner_ar"].count == 3 * 5
    assert colls["shared_ar"].count == 3 + 1  # once per outer iteration, once from ENTRY
    assert colls["branch_ar"].count == 1
    assert colls["branch_ar"].axes == ("data", "tensor")
    assert (colls["dyn_ag"].count, colls["dyn_ag"].unknown_trip_count) == (1, True)
    assert not any(colls[name].unknown_trip_count for name in ("inner_ar", "shared_ar", "branch_ar"))
    assert count_by(colls.values(), kind="all-reduce") == 15 + 4 + 1
    assert count_by(colls.values(), axes=("data",)) == 15 + 1
    assert bytes_by_axes(colls.values()) == {
        ("data",): 15 * 32 + 64,
        ("tensor",): 4 * 32,
        ("data", "tensor"): 32,
    }


# --------------------------------------------------------------------------------------------------
# Small pure helpers
# --------------------------------------------------------------------------------------------------


def test_parse_shape_handles_scalars_tuples_layouts_and_small_types():
    assert parse_shape("f32[]") == ArrayShape("f32", ())
    assert parse_shape("f32[]").nbytes == 4
    assert parse_shape("bf16[4,8]{1,0:T(8,128)(2,1)}").nbytes == 64
    assert parse_shape("pred[3]").nbytes == 3
    assert parse_shape("s4[3]").nbytes == 2
    assert parse_shape("(f32[4]{0}, (u8[2,2]{1,0}, s32[]))") == (
        ArrayShape("f32", (4,)),
        (ArrayShape("u8", (2, 2)), ArrayShape("s32", ())),
    )


def test_ring_wire_bytes_follow_the_ring_algorithm_formulas():
    assert ring_wire_bytes("all-reduce", 100, 4) == pytest.approx(150)
    assert ring_wire_bytes("all-gather", 100, 4) == pytest.approx(75)
    assert ring_wire_bytes("reduce-scatter", 25, 4) == pytest.approx(75)
    assert ring_wire_bytes("all-to-all", 100, 4) == pytest.approx(75)
    assert ring_wire_bytes("collective-permute", 100, 2) == 100
    assert ring_wire_bytes("all-reduce", 100, 1) == 0
    coll = Collective("all-reduce", ("data",), "f32", bytes=100, count=3, group_size=4, name="x")
    assert coll.total_bytes == 300
    assert coll.total_wire_bytes == pytest.approx(450)


def test_format_bytes_is_human_readable():
    assert format_bytes(128) == "128 B"
    assert format_bytes(1.5 * 2**20) == "1.5 MiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"


# --------------------------------------------------------------------------------------------------
# Megatron analytical figures
# --------------------------------------------------------------------------------------------------

# Table 1 of Narayanan et al. (SC21): billions of parameters, heads, hidden, layers, tensor, pipe,
# GPUs, global batch. V = 51200, s = 2048 throughout.
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512),
    (3.6, 32, 3072, 30, 2, 1, 64, 512),
    (7.5, 32, 4096, 36, 4, 1, 128, 512),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
]


@pytest.mark.parametrize(
    ("billions", "heads", "hidden", "layers", "tensor", "pipe", "gpus", "batch"), TABLE_1
)
def test_parameter_counts_reproduce_table_1(billions, heads, hidden, layers, tensor, pipe, gpus, batch):
    figures = megatron_figures(
        vocab_size=51200,
        hidden=hidden,
        layers=layers,
        seq_len=2048,
        heads=heads,
        global_batch=batch,
        data=gpus // (tensor * pipe),
        pipe=pipe,
        tensor=tensor,
        microbatches=1,
        remat=True,
    )
    assert round(figures.params / 1e9, 1) == billions


def small_figures(**overrides):
    config = {
        "vocab_size": 512,
        "hidden": 64,
        "layers": 4,
        "seq_len": 32,
        "heads": 4,
        "global_batch": 16,
        "data": 2,
        "pipe": 2,
        "tensor": 2,
        "microbatches": 4,
        "remat": False,
    }
    return megatron_figures(**(config | overrides))


def test_flops_match_the_papers_closed_forms():
    f = small_figures()
    B, s, l, h, V = 16, 32, 4, 64, 512
    assert f.flops_per_iteration == pytest.approx(
        96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    )
    assert f.flops_per_iteration_no_remat == pytest.approx(
        72 * B * s * l * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V
    )
    # Recomputation adds exactly one forward pass of the transformer layers.
    one_forward = 24 * B * s * l * h**2 * (1 + s / (6 * h))
    assert f.flops_per_iteration - f.flops_per_iteration_no_remat == pytest.approx(one_forward)
    assert f.params == 12 * l * h**2 + 13 * l * h + (V + s) * h


def test_communication_figures_per_device():
    f = small_figures()
    b, s, h, m, bytes_per = 16 // (2 * 4), 32, 64, 4, 4
    activation = b * s * h * bytes_per
    assert f.microbatch_size == 2 and f.layers_per_stage == 2
    assert f.tensor_allreduces_per_layer == 4
    assert f.tensor_layer_allreduces == m * 2 * 4
    assert f.tensor_allreduce_bytes == activation
    assert f.tensor_layer_bytes == m * 2 * 4 * activation
    assert f.tensor_embedding_bytes == m * 2 * activation
    assert f.tensor_loss_bytes == m * 3 * b * s * bytes_per
    assert f.pipe_bytes == 2 * m * activation
    assert f.data_bytes == f.params * bytes_per / 4
    assert f.bytes_by_axes == {("data",): f.data_bytes, ("pipe",): f.pipe_bytes, ("tensor",): f.tensor_bytes}

    with_remat = small_figures(remat=True)
    assert with_remat.tensor_allreduces_per_layer == 6
    assert with_remat.tensor_layer_bytes == pytest.approx(f.tensor_layer_bytes * 6 / 4)


def test_axes_of_size_one_communicate_nothing():
    f = small_figures(data=1, pipe=1, tensor=1, global_batch=8)
    assert (f.data_bytes, f.pipe_bytes, f.tensor_bytes, f.tensor_layer_allreduces) == (0, 0, 0, 0)
    assert f.tensor_allreduces_per_layer == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"global_batch": 6}, "global_batch"),
        ({"layers": 3}, "layers"),
        ({"heads": 3}, "heads"),
        ({"tensor": 0}, "tensor"),
    ],
)
def test_impossible_layouts_are_rejected(override, message):
    with pytest.raises(ValueError, match=message):
        small_figures(**override)


def test_mesh_form_replica_groups():
    """XLA 0.10 (Shardy) prints some groups as a named mesh plus the axes a group spans."""
    from meshtron.hlo.collectives import _device_groups

    plain = "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}, use_global_device_ids=true"
    assert _device_groups(plain, 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    permuted = "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    # ids laid out as iota(8).reshape(2,4).T -> grid [[0,4],[1,5],[2,6],[3,7]] over (4,1,2); groups vary axis_0.
    assert _device_groups(permuted, 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
