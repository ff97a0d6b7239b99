"""Mesh construction: axis order, -1 resolution, subsets, and device-count flags."""

import jax
import pytest

from meshtron.config import ConfigError, MeshConfig
from meshtron.mesh import build_mesh, ensure_cpu_devices, resolve_sizes


def test_axes_are_data_context_pipe_tensor_with_tensor_innermost():
    mesh = build_mesh(MeshConfig(2, 1, 4))
    assert mesh.axis_names == ("data", "context", "pipe", "tensor")
    assert dict(mesh.shape) == {"data": 2, "context": 1, "pipe": 1, "tensor": 4}
    ids = [[d.id for d in row] for row in mesh.devices[:, 0, 0, :]]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]  # tensor groups are neighbouring devices
    mesh = build_mesh(MeshConfig(2, 1, 2, context=2))
    assert [d.id for d in mesh.devices[0, :, 0, 0]] == [0, 2]  # context next to tensor (Megatron's tp-cp-dp-pp)


def test_minus_one_takes_the_rest_and_smaller_meshes_use_a_subset(capsys):
    assert resolve_sizes(MeshConfig(-1, 1, 2), 8) == MeshConfig(4, 1, 2)
    assert resolve_sizes(MeshConfig(1, 1, 2, context=-1), 8) == MeshConfig(1, 1, 2, context=4)
    mesh = build_mesh(MeshConfig(2, 1, 2), verbose=True)
    assert mesh.devices.size == 4
    assert "uses 4 of 8 devices" in capsys.readouterr().err


def test_mesh_larger_than_devices_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"parallel: data x pipe x tensor = 4 x 1 x 4 = 16 devices, but this run has 8"):
        build_mesh(MeshConfig(4, 1, 4))
    with pytest.raises(ConfigError, match=r"parallel: data x context x pipe x tensor = 2 x 4 x 1 x 2 = 16 devices"):
        build_mesh(MeshConfig(2, 1, 2, context=4))
    with pytest.raises(ConfigError, match="parallel.data=-1"):
        resolve_sizes(MeshConfig(-1, 1, 3), 8)


def test_cpu_device_flag_is_appended_never_replaced(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    monkeypatch.setattr(jax._src.xla_bridge, "backends_are_initialized", lambda: False)
    assert ensure_cpu_devices(16)
    import os

    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=16"
    # A count the user chose is left alone.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert not ensure_cpu_devices(16)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
