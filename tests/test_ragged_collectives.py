"""The ragged all-to-alls of a compiled program (``meshtron.hlo.collectives.ragged_all_to_alls``): their
send and receive buffers, the mesh axes they talk over and how often they run, from the HLO text (on the
H100 program of a ragged training step: tests/test_moe_dispatch.py)."""

import pytest

from meshtron.hlo.collectives import collectives, ragged_all_to_alls, ring_wire_bytes

# two ragged exchanges over data (4 ranks, data x tensor = 4 x 2), the routed rows into the worst case and
# back, inside a loop that runs 3 times
_PROGRAM = """HloModule m

%body (carry: (s32[], f32[256,64])) -> (s32[], f32[256,64]) {
  %carry = (s32[], f32[256,64]) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[256,64]) %carry), index=0
  %rows = f32[256,64] get-tuple-element((s32[], f32[256,64]) %carry), index=1
  %zero = f32[] constant(0)
  %wide = f32[1024,64] broadcast(f32[] %zero), dimensions={}
  %narrow = f32[256,64] broadcast(f32[] %zero), dimensions={}
  %offsets = s64[4] constant({0, 0, 0, 0})
  %out = f32[1024,64] ragged-all-to-all(f32[256,64] %rows, f32[1024,64] %wide, s64[4] %offsets, s64[4] %offsets, s64[4] %offsets, s64[4] %offsets), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}
  %back = f32[256,64] ragged-all-to-all(f32[1024,64] %out, f32[256,64] %narrow, s64[4] %offsets, s64[4] %offsets, s64[4] %offsets, s64[4] %offsets), channel_id=2, replica_groups={{0,2,4,6},{1,3,5,7}}
  %one = s32[] constant(1)
  %next = s32[] add(s32[] %i, s32[] %one)
  ROOT %t = (s32[], f32[256,64]) tuple(s32[] %next, f32[256,64] %back)
}

%cond (carry: (s32[], f32[256,64])) -> pred[] {
  %carry = (s32[], f32[256,64]) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[256,64]) %carry), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

ENTRY %main (x: f32[256,64]) -> (s32[], f32[256,64]) {
  %x = f32[256,64] parameter(0)
  %start = s32[] constant(0)
  %init = (s32[], f32[256,64]) tuple(s32[] %start, f32[256,64] %x)
  ROOT %loop = (s32[], f32[256,64]) while((s32[], f32[256,64]) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_ragged_all_to_alls_are_their_send_and_receive_buffers_over_their_axes():
    mesh = {"data": 4, "tensor": 2}
    dispatch, combine = ragged_all_to_alls(_PROGRAM, mesh)
    rows = 64 * 4  # bytes of one f32 row of 64
    assert (dispatch.bytes, dispatch.receive_bytes) == (256 * rows, 1024 * rows)
    assert (combine.bytes, combine.receive_bytes) == (1024 * rows, 256 * rows)
    assert dispatch.axes == combine.axes == ("data",) and dispatch.group_size == 4
    assert dispatch.count == combine.count == 3
    # balanced, each trip moves the 256 routed rows (the smaller buffer), 3/4 of them to other ranks
    assert dispatch.total_wire_bytes == combine.total_wire_bytes == pytest.approx(3 * 3 / 4 * 256 * rows)
    assert ring_wire_bytes("ragged-all-to-all", 100.0, 4) == pytest.approx(75.0)
    assert collectives(_PROGRAM, mesh) == []  # their bytes are bounds: the plain list leaves them out
