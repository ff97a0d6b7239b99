"""XLA SPMD partitioner CHECK failure: gather inside a partially-manual shard_map.

Aborts (SIGABRT, exit 134) on jax/jaxlib 0.12.0.1 (CPU, Python 3.12):

  spmd_partitioner_util.cc:498] Check failed: partition_group_list.num_replica_groups() *
  partition_group_list.num_devices_per_group() == device_groups.num_devices_per_group()

  stack: ExpandDeviceGroupsWithIota <- ExpandDeviceGroups <- AllReduceAlongShardingDims
         <- PartitionGatherTrivialSlicedOperandDimensions <- PartitionGather
         <- PartitionGatherOperandPassthroughDimensions <- SpmdPartitioningVisitor::HandleGather

Works (prints 496.0) on jax/jaxlib 0.10.2 (Python 3.11).

Trigger: a gather (here jnp.take with constant indices) whose operand is sharded over TWO
automatic mesh axes -- the gathered dimension over one ("pipe"), a passthrough dimension over
the other ("tensor") -- inside a jax.shard_map that is manual over a THIRD axis ("data"), i.e.
the gather operand before spmd-partitioning has sharding
{mesh['data'=2,'pipe'=2,'tensor'=2], [{'pipe'}, {'tensor'}], manual={'data'}}.
Also aborts with non-constant indices, with check_vma=True, with jax_use_shardy_partitioner=False,
and with another choice of manual axis (e.g. manual "tensor", operand P("data", "pipe")).
No crash if: the shard_map is removed (fully automatic), or the operand is sharded over only one
of the two axes (P("pipe") or P(None, "tensor")), or the gather is replaced by
reshape/transpose, a concatenate of static slices, or a dynamic_slice.
In 0.10.2 the same gather partitions to a masked local gather + all-reduce with
replica_groups={{0,2},{1,3},{4,6},{5,7}} (over "pipe").

Run: python xla_repro.py   (forces 8 host CPU devices)
"""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

print("jax", jax.__version__, "jaxlib", jaxlib.__version__)

mesh = jax.make_mesh((2, 2, 2), ("data", "pipe", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
perm = jnp.asarray(np.array([0, 2, 1, 3], np.int32))


def per_data_shard(w):  # manual over "data"; "pipe" and "tensor" are left to the partitioner
    return jnp.take(w, perm, axis=0).sum()


@jax.jit
def f(w):
    return jax.shard_map(per_data_shard, mesh=mesh, in_specs=P(), out_specs=P(),
                         axis_names={"data"}, check_vma=False)(w)


w = jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(4, 8), NamedSharding(mesh, P("pipe", "tensor")))
with jax.set_mesh(mesh):
    print(f(w))  # expected 496.0
