"""Image augmentation: on-device augmentation (policies, mixup/CutMix, erasing, colour), image sizes
over a run, and their config checks.

- `augment`: jittable batch preprocessing: normalisation, augmentation, random erasing,
  mixup/CutMix.
- `randaugment`: RandAugment, TrivialAugment-Wide and AutoAugment ops on one uint8 image.
- `augmix`: AugMix, from the RandAugment ops.
- `photometric`: colour jitter and Gaussian blur, as torchvision's.
- `image_sizes`: progressive resizing (`augment.train_sizes`) and evaluation at another size.
- `aug_checks`: the config checks of the augmentation and loss keys (no JAX).

Nothing is imported here: `import flaxtpu.augmentation.<module>` loads that module and what it
imports, no more.
"""
