"""A VGG-like network built for time-to-accuracy: airbench's shape (Jordan 2024) as a Flax model.

    stem: 3x3 conv (no bias) -> BatchNorm -> GELU  (fastnet_whiten: a frozen 2x2 whitening conv -> GELU)
    per block: 3x3 conv -> 2x2 max pool -> BatchNorm -> GELU -> 3x3 conv -> BatchNorm -> GELU
    head: global max pool -> Dense without bias, logits scaled by 1/9

Three pooling blocks take 32x32 (or 28x28) images to 4x4 (3x3). Few, wide,
plain layers do more per FLOP on any hardware than deep residual stacks at
this size: `fastnet` (widths 64/256/256, airbench94's) with a learned 3x3
stem, `fastnet_s` (16/32/64) the MNIST recipe's.

`fastnet_whiten` (`whiten=True`) is airbench94's network in full, the
cifar10_fast recipe's model:
  - the stem is a 2x2 convolution without padding whose kernel whitens 2x2
    patches of the training images (`whitening_kernel`: the eigenvectors of
    their covariance scaled by 1/sqrt(eigenvalue), and their negatives), set
    before step 1 and frozen by the recipe (`optimizer.freeze`), then GELU;
  - BatchNorm learns a bias only (no scale), with running statistics of
    momentum 0.6 and epsilon 1e-12;
  - each block's convolutions start as partial identities (the first
    min(in, out) output channels pass their input channel through, as
    torch.nn.init.dirac_), the rest and the head as PyTorch initialises them.
Not airbench's: the GELU is tanh-approximated (Flax's default). How long the
whitening bias trains is the optimizer's (`optimizer.freeze_after`).
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from flaxtpu.models.nets.resnet import batch_norm

WHITEN_PATCH = 2  # the whitening stem's kernel side
WHITEN_EPSILON = 5e-4  # added to the eigenvalues: the flattest directions are not amplified without bound


# PyTorch's default for convolutions and dense layers (kaiming_uniform with a=sqrt(5)): variance
# 1/(3 fan_in). airbench's learning rates assume it; with BatchNorm after every convolution a
# kernel's scale sets its effective learning rate.
TORCH_DEFAULT_INIT = nn.initializers.variance_scaling(1 / 3, 'fan_in', 'uniform')


def whitening_kernel(images, chunk: int = 250) -> np.ndarray:
  """The stem kernel [2, 2, C, 8C] that whitens the 2x2 patches of `images` (float [N, H, W, C], normalised).

  Output channel k < 4C projects a patch on the covariance's k-th eigenvector
  (largest first, its largest entry positive: the same kernel from any LAPACK)
  divided by sqrt(its eigenvalue + epsilon); channel 4C + k is its negative,
  so that the GELU after the stem keeps both signs. The covariance is summed
  over chunks of images: memory stays small at any image size.
  """
  side = WHITEN_PATCH
  channels = images.shape[-1]
  dims = side * side * channels
  moments, count = np.zeros((dims, dims)), 0
  for start in range(0, len(images), chunk):
    block = np.asarray(images[start:start + chunk], np.float64)
    _, height, width, _ = block.shape
    patches = np.stack([block[:, i:height - side + 1 + i, j:width - side + 1 + j, :]
                        for i in range(side) for j in range(side)], axis=3)  # [n, H', W', 4, C]
    patches = patches.reshape(-1, dims)  # (row, column, channel) order, as a kernel
    moments += patches.T @ patches  # second moments about 0, as airbench
    count += len(patches)
  eigenvalues, eigenvectors = np.linalg.eigh(moments / count)
  order = np.argsort(eigenvalues)[::-1]
  eigenvalues, eigenvectors = eigenvalues[order], eigenvectors[:, order]
  largest = np.argmax(np.abs(eigenvectors), axis=0)
  eigenvectors = eigenvectors * np.sign(eigenvectors[largest, np.arange(dims)])
  scaled = eigenvectors / np.sqrt(eigenvalues + WHITEN_EPSILON)  # [4C, 4C], one direction per column
  kernel = np.concatenate([scaled, -scaled], axis=1)
  return kernel.reshape(side, side, channels, 2 * dims).astype(np.float32)


def partial_dirac(base=TORCH_DEFAULT_INIT):
  """`base`, but the first min(in, out) output channels copy their input channel through (the centre tap)."""

  def init(key, shape, dtype=jnp.float32):
    kernel = base(key, shape, dtype)
    height, width, inputs, outputs = shape
    identity = min(inputs, outputs)
    dirac = jnp.zeros((height, width, inputs, identity), dtype)
    dirac = dirac.at[height // 2, width // 2].set(jnp.eye(inputs, identity, dtype=dtype))
    return kernel.at[..., :identity].set(dirac)

  return init


class ConvBlock(nn.Module):
  """conv -> pool -> BN -> GELU -> conv -> BN -> GELU: one remat unit."""
  features: int
  train: bool
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None
  airbench_init: bool = False  # partial identity kernels, BatchNorm without scale

  @nn.compact
  def __call__(self, x):
    kernel_init = partial_dirac() if self.airbench_init else nn.initializers.lecun_normal()
    conv = functools.partial(nn.Conv, self.features, (3, 3), use_bias=False, dtype=self.dtype,
                             kernel_init=kernel_init)
    norm = batch_norm(self.train, self.dtype, self.bn_axis_name)
    if self.airbench_init:  # airbench's BatchNorm: a bias only, statistics that follow the weights quickly
      norm = functools.partial(norm, use_scale=False, momentum=0.6, epsilon=1e-12)
    x = nn.max_pool(conv()(x), (2, 2), strides=(2, 2))
    x = nn.gelu(norm()(x))
    return nn.gelu(norm()(conv()(x)))


class FastNet(nn.Module):
  num_classes: int
  stem_width: int
  widths: Sequence[int]
  block: Callable[..., nn.Module] = ConvBlock
  dtype: Any = jnp.float32
  bn_axis_name: Optional[str] = None
  logit_scale: float = 1 / 9  # airbench's: small initial logits train faster with a high learning rate
  whiten: bool = False  # airbench94's whitening stem and initialisation (module doc); ignores stem_width

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = x.astype(self.dtype)
    if self.whiten:  # kernel: whitening_kernel(train images), set before training (steps.fit_to_data)
      side, channels = WHITEN_PATCH, x.shape[-1]
      x = nn.gelu(nn.Conv(2 * side * side * channels, (side, side), padding='VALID', dtype=self.dtype,
                          name='stem')(x))
    else:
      norm = batch_norm(train, self.dtype, self.bn_axis_name)
      x = nn.Conv(self.stem_width, (3, 3), use_bias=False, dtype=self.dtype, name='stem')(x)
      x = nn.gelu(norm(name='stem_bn')(x))
    for index, width in enumerate(self.widths):
      x = self.block(width, train=train, dtype=self.dtype, bn_axis_name=self.bn_axis_name,
                     airbench_init=self.whiten, name=f'block{index + 1}')(x)
    x = jnp.max(x, axis=(1, 2))
    head_init = TORCH_DEFAULT_INIT if self.whiten else nn.initializers.lecun_normal()
    logits = nn.Dense(self.num_classes, use_bias=False, dtype=self.dtype, kernel_init=head_init,
                      name='head')(x)
    return (logits * self.logit_scale).astype(jnp.float32)
