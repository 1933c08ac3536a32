"""Devices, the mesh, and where every array lives.

`jit` (the default) runs one program over a `Mesh` with axes ('data', 'fsdp'):
the batch is split over both axes, parameters and optimizer state are
replicated or, with `mesh.fsdp > 1`, split along 'fsdp'. `pmap` replicates the
state over the local devices and splits the batch along a leading axis.
"""

from __future__ import annotations

import logging

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flaxtpu.settings.errors import UserError

BATCH_AXES = ('data', 'fsdp')  # the batch is split over every device
PMAP_AXIS = 'batch'


def check_platform(required: str) -> None:
  """Stops with one line when `require_platform` names a platform that is not here."""
  found = jax.default_backend()
  if required and found != required:
    raise UserError(
        f'config.require_platform={required!r} but JAX found {found} '
        f'({jax.device_count()} x {jax.devices()[0].device_kind}); install jax[{required}] '
        f'on a {required.upper()} machine, or pass --config.require_platform= to run on {found}')


def one_step_in_flight() -> bool:
  """Whether to wait for each step before dispatching the next.

  XLA:CPU runs every virtual device's collectives on one shared thread pool;
  two programs in flight at once can deadlock their all-reduces (seen with 8
  devices on 2 cores). Accelerators keep the usual asynchronous dispatch.
  """
  return jax.default_backend() == 'cpu' and jax.device_count() > 1


def describe_devices() -> str:
  device = jax.devices()[0]
  return (f'platform={jax.default_backend()} kind={device.device_kind} '
          f'devices={jax.device_count()} (local {jax.local_device_count()}) '
          f'process={jax.process_index()}/{jax.process_count()}')


def make_mesh(config: ml_collections.ConfigDict) -> Mesh:
  """A ('data', 'fsdp') mesh over all devices; -1 takes whatever the other axis leaves."""
  count = jax.device_count()
  data, fsdp = config.mesh.data, config.mesh.fsdp
  if data == -1:
    data = count // fsdp if fsdp > 0 and count % fsdp == 0 else -1
  if fsdp == -1:
    fsdp = count // data if count % data == 0 else -1
  if data * fsdp != count or data < 1 or fsdp < 1:
    raise UserError(f'config.mesh.data={config.mesh.data} x config.mesh.fsdp={config.mesh.fsdp} '
                    f'does not fit {count} devices; make their product {count} (-1 fills one axis)')
  # Auto axes: sharding propagates through the step as under the old pjit.
  return jax.make_mesh((data, fsdp), ('data', 'fsdp'), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices())


def check_batch_size(name: str, batch_size: int) -> None:
  """A global batch must split evenly over every device.

  This is the one batch-size check: equal local device counts per process
  make it cover the per-process slice and, under pmap, each process's split
  over its local devices too.
  """
  count = jax.device_count()
  if batch_size % count:
    raise UserError(f'config.{name}={batch_size} does not divide over {count} devices; '
                    f'use a multiple of {count}')


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int, min_size: int) -> P:
  """Splits the largest dimension that `fsdp_size` divides; small arrays stay replicated.

  A grouped convolution's kernel ([h, w, in / groups, out], spatial, fewer inputs than outputs but more than
  one: RegNet's, ResNeXt's) splits its inputs or nothing: split over its outputs, while the convolution
  before it splits its own outputs, XLA:CPU's SPMD partitioner aborts on the kernel's gradient (jax 0.10.2,
  convolution_handler.cc `new_input_batch_size % new_output_batch_size == 0`; repro in docs/design.md).
  """
  if fsdp_size == 1 or int(np.prod(shape)) < min_size:
    return P()
  if len(shape) == 4 and shape[0] * shape[1] > 1 and 1 < shape[2] < shape[3]:
    return P(None, None, 'fsdp', None) if shape[2] % fsdp_size == 0 else P()
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % fsdp_size == 0:
      spec = [None] * len(shape)
      spec[dim] = 'fsdp'
      return P(*spec)
  return P()


def state_shardings(abstract_state, mesh: Mesh, config: ml_collections.ConfigDict):
  """NamedShardings for every leaf of the train state (shapes from jax.eval_shape)."""
  fsdp_size = mesh.shape['fsdp']
  return jax.tree.map(
      lambda leaf: NamedSharding(mesh, fsdp_spec(leaf.shape, fsdp_size, config.mesh.fsdp_min_size)),
      abstract_state)


def to_global(local_batch, sharding: NamedSharding):
  """This process's rows -> one global array split over every device of the mesh."""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)


# --- pmap -------------------------------------------------------------------


def _local_devices_sharding() -> NamedSharding:
  """Splits a leading axis over this process's devices: the layout pmap consumes."""
  return NamedSharding(Mesh(np.array(jax.local_devices()), (PMAP_AXIS,)), P(PMAP_AXIS))


def to_pmap_batch(local_batch):
  """[local_batch, ...] -> [local_devices, local_batch / local_devices, ...] on the devices."""
  count = jax.local_device_count()
  return jax.tree.map(
      lambda x: jax.device_put(x.reshape(count, -1, *x.shape[1:]), _local_devices_sharding()),
      local_batch)


def host_copy(tree):
  """Numpy copies of global arrays, gathered from every process when they are split."""

  def fetch(x):
    if x.is_fully_addressable:
      return np.asarray(x)
    if x.sharding.is_fully_replicated:
      return np.asarray(x.addressable_shards[0].data)
    return multihost_utils.process_allgather(x, tiled=True)

  return jax.tree.map(fetch, tree)


def replicate(tree):
  """One copy of every leaf on each local device, for pmap."""
  count = jax.local_device_count()
  return jax.tree.map(
      lambda x: jax.device_put(np.broadcast_to(x, (count, *x.shape)), _local_devices_sharding()),
      host_copy(tree))


def unreplicate_to_mesh(tree, mesh: Mesh):
  """pmap's per-device copies -> replicated global arrays on the mesh (what orbax saves)."""
  first_copy = jax.tree.map(lambda x: x[0], host_copy(tree))
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated(mesh), x),
                      first_copy)


def log_mesh(mesh: Mesh, parallelism: str) -> None:
  logging.info('devices: %s', describe_devices())
  if parallelism == 'pmap':
    logging.info('parallelism: pmap over %d local devices (axis %r)', jax.local_device_count(),
                 PMAP_AXIS)
  else:
    logging.info('parallelism: jit over mesh %s', dict(mesh.shape))
