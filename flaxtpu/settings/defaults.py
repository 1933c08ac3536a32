"""Every config key flaxtpu knows, with its default and what it means.

Recipes (`configs/cifar10.py`, your own config anywhere) start from
`flaxtpu.settings.defaults.get_config()` and change only what differs, so a key exists
in every recipe and `--config.KEY=VALUE` works for all of them:

    from flaxtpu.settings import defaults

    def get_config():
      config = defaults.get_config()
      config.dataset.folder = '/data/my_photos'
      return config

The config comes back locked: assigning a key that does not exist (a typo
such as `config.model.nme`) is an error, not a new key. This file must not
import JAX: the CLI reads it before JAX starts.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # --- data -------------------------------------------------------------
  config.dataset = ml_collections.ConfigDict()
  # TFDS catalog name (cifar10, cifar100, mnist, fashion_mnist, ...).
  config.dataset.name = 'cifar10'
  config.dataset.folder = ''  # Image-folder root (split/class/image); wins over `name` when set.
  config.dataset.data_dir = ''  # TFDS data_dir ('' = TFDS default, ~/tensorflow_datasets).
  config.dataset.train_split = 'train'  # Split to train on; TFDS-style slices work: 'train[:90%]'.
  # Split to evaluate on (every example counted once), e.g. 'train[90%:]'.
  config.dataset.eval_split = 'test'
  # More splits evaluated with it during training, e.g. ('train[:5000]',): logged as
  # eval_train_5000_accuracy; eval_split picks the best checkpoint.
  config.dataset.eval_splits = ()
  # Square side the model sees; 0 = init_from's published size, else the native size (every image
  # must share it).
  config.dataset.image_size = 0
  # Eval at image_size > 0: resize the shorter side to image_size / this, take the centre (0 =
  # init_from's, else 0.875).
  config.dataset.crop_fraction = 0.0
  # auto | memory | none: decode once into host memory (auto: when it fits 1/8 of RAM, at most 4
  # GiB) or stream from disk.
  config.dataset.cache = 'auto'
  # Where decoded splits are kept for the next run (a local folder; '' = ~/.cache/flaxtpu/decoded;
  # 'none' = decode every run). Keyed by each file's path, size and mtime and the decode settings.
  config.dataset.decoded_cache_dir = ''
  # Skip files that cannot be decoded (logged) instead of stopping with their name.
  config.dataset.skip_corrupt = False
  # error | drop: a class folder of an eval split that training (or the checkpoint) lacks stops the
  # run naming it, or its images are left out with a warning.
  config.dataset.unknown_classes = 'error'
  # unit (pixels/255 in [0, 1]) | standardize (per-channel mean/std of the train split) | fixed
  # (dataset.mean/std) | auto (init_from's, else unit).
  config.dataset.normalize = 'auto'
  # normalize=fixed: per-channel mean of pixels in [0, 1], e.g. ImageNet's (0.485, 0.456, 0.406).
  config.dataset.mean = ()
  # normalize=fixed: per-channel std, e.g. ImageNet's (0.229, 0.224, 0.225).
  config.dataset.std = ()
  # Labels from a file instead of class folders: a CSV with a header (path, then label, or labels
  # with ';'-separated tags, optional split) or header-less rows path,label[,label...]; or JSON
  # Lines with those keys. Image paths are relative to dataset.folder ('' = the file's folder).
  # Splits: the split column's values (train_split='train'), else 'all' sliced ('all[:80%]').
  config.dataset.labels = ''
  # WebDataset-style tar shards, e.g. '/data/train-{0000..0127}.tar' (brace ranges and globs;
  # '{split}' becomes the split name). Members KEY.jpg (or .png, ...) with KEY.cls (a class index
  # or name) or KEY.json ({"label": ...} or {"labels": [...]}).
  config.dataset.shards = ''
  # Parquet files, e.g. a Hugging Face datasets copy: a file, a folder or a glob ('{split}' as for
  # shards); in a folder, a file's split is its name's first word (train-00000-of-00004.parquet).
  config.dataset.parquet = ''
  # Label files and parquet: the image column ('' = image, img or path) and the label column ('' =
  # label or labels).
  config.dataset.image_column = ''
  config.dataset.label_column = ''
  # none | balanced (class c weighs n / (C x n_c), Keras' and sklearn's rule) | a CSV or JSON file
  # of class,weight: each example's loss is weighted by its class (multilabel: each class's term).
  config.dataset.class_weights = 'none'
  # shuffle (a seeded permutation per epoch) | balanced (every class drawn equally often, with
  # replacement) | shards (each process streams its own shards in a seeded order, WebDataset-style).
  config.dataset.sampling = 'shuffle'

  config.input = ml_collections.ConfigDict()
  # Processes that read and decode streamed batches (-1 = one per core but one, at most 32; 0 = a
  # thread).
  config.input.workers = -1
  config.input.prefetch = 4  # Batches decoded ahead of the training step.
  # The `workers` decode in threads of the trainer instead of processes: no hand-over of the batches
  # through a pipe, but one process's threads share its GIL, which caps them near 11,000-13,000 img/s
  # on any number of cores, and on a gVisor sandbox (Cloud TPU hosts) their file reads queue behind
  # each other (docs/performance.md): processes by default.
  config.input.threads = False

  # --- augmentation (train batches only) --------------------------------
  config.augment = ml_collections.ConfigDict()
  # At image_size > 0: random-resized crop's area fraction range (Inception-style).
  config.augment.crop_area = (0.08, 1.0)
  # ... and its aspect-ratio range (sampled log-uniformly).
  config.augment.crop_aspect = (3 / 4, 4 / 3)
  # On the device, after the crop:
  config.augment.crop_padding = 0  # Random crop after padding by this many pixels (0 = off).
  # zeros (black) | reflect (mirrored pixels, airbench's) | edge (repeated).
  config.augment.crop_pad_mode = 'zeros'
  config.augment.flip = False  # Random horizontal flip.
  # With flip: a seeded half of the train images is mirrored in even epochs, the other half in odd
  # ones (airbench), not a coin per view.
  config.augment.alternate_flip = False
  # '' | randaugment | trivialaugment (TrivialAugment-Wide) | autoaugment (its ImageNet policy) |
  # augmix (augmix_* below), after crop and flip.
  config.augment.policy = ''
  config.augment.randaugment_layers = 2  # randaugment: ops applied per image (N).
  # randaugment: strength M on the 0..30 scale of torchvision/timm.
  config.augment.randaugment_magnitude = 9.0
  config.augment.cutout = 0  # Side of a random square zeroed per image (0 = off).
  # Random erasing (Zhong et al. 2017; timm's --reprob/--remode/--recount), after normalisation as
  # in timm: with this probability an image gets 1..erase_count boxes (0 = off; timm's recipes
  # 0.25).
  config.augment.erase_prob = 0.0
  # pixel (per-pixel normal noise, timm's default) | rand (a normal colour per box) | const (0: the
  # mean colour when standardised).
  config.augment.erase_mode = 'pixel'
  config.augment.erase_count = 1  # Most boxes per image (uniform in 1..count; they share the area).
  config.augment.erase_area = (0.02, 1 / 3)  # Range of the image's area a box covers (uniform).
  config.augment.erase_aspect = (0.3, 1 / 0.3)  # Range of a box's height / width (log-uniform).
  # mixup/CutMix: each example is mixed with a neighbour in the batch (per example: lambda, box,
  # which one).
  config.augment.mixup_alpha = 0.0  # mixup lambda ~ Beta(alpha, alpha) (0 = off; 0.2-0.8 usual).
  config.augment.cutmix_alpha = 0.0  # CutMix box area ~ Beta(alpha, alpha) (0 = off; 1.0 usual).
  config.augment.mix_prob = 1.0  # Probability that an example is mixed at all.
  # With both alphas set: probability of CutMix instead of mixup.
  config.augment.mix_switch_prob = 0.5

  # --- repeated augmentation, AugMix, colour jitter, blur; the BCE loss (flaxtpu/augmentation/aug_checks.py)
  # ---
  # Copies of each sampled image per batch, each augmented on its own (DeiT/timm's RASampler; 1 = off,
  # DeiT: 3). An epoch keeps its number of steps, so it shows 1/repeats of the split (data/repeated.py).
  config.augment.repeats = 1
  # policy=augmix (flaxtpu/augmentation/augmix.py, timm's augmix-m3-w3-d-1): op strength severity/10 at most,
  # `width` chains of `depth` ops (-1 = 1..3 at random) mixed with Dirichlet(alpha), blended by
  # Beta(alpha, alpha).
  config.augment.augmix_severity = 3
  config.augment.augmix_width = 3
  config.augment.augmix_depth = -1
  config.augment.augmix_alpha = 1.0
  # torchvision's ColorJitter after the policy (flaxtpu/augmentation/photometric.py): brightness, contrast and
  # saturation factors in [1 - s, 1 + s] (0 = off; timm: 0.4), hue shift in [-h, h] (<= 0.5), in a
  # random order per image, the whole jitter with probability color_jitter_prob.
  config.augment.color_jitter = 0.0
  config.augment.color_jitter_hue = 0.0
  config.augment.color_jitter_prob = 1.0
  # Gaussian blur after the jitter with this probability (0 = off; timm's gaussian_blur_prob), sigma
  # uniform in blur_sigma, blur_kernel taps (odd; capped to the image).
  config.augment.blur = 0.0
  config.augment.blur_sigma = (0.1, 2.0)
  config.augment.blur_kernel = 23
  # softmax (cross-entropy) | bce (a sigmoid per class for single-label training, timm's
  # BinaryCrossEntropy; eval accuracy from the argmax, eval_loss stays the softmax's; flaxtpu/loss/bce.py).
  config.loss = 'softmax'
  # bce: targets above this become 1, the rest 0 (0 = off; timm's recipes 0.2).
  config.bce_target_threshold = 0.0
  config.bce_sum = False  # bce: sum over the classes instead of timm's mean (C times larger).

  # --- model ------------------------------------------------------------
  config.model = ml_collections.ConfigDict()
  # cnn | fastnet_s | fastnet | fastnet_whiten | resnet20/32/44/56/110 | resnet18/34/50/101/152 |
  # vit_ti/s/b/l | deit_ti/s/b_distilled | dinov2_s/b/l(_reg) | clip_b/l | convnext_t/s/b/l | swin_t/s/b |
  # efficientnet_b0-b7 | mobilenetv3_l/s | resnet18d-152d | resnext* | wide_resnet* | regnetx_* | regnety_*.
  config.model.name = 'cnn'
  # none | full | a jax.checkpoint_policies name (dots_saveable, ...) | auto: the fastest of none,
  # dots_saveable, dots_with_no_batch_dims_saveable, full whose compiled train step fits one device's
  # memory (flaxtpu/step/remat_choice.py).
  config.model.remat = 'none'
  # vit/convnext: patch side (convnext: stem stride); 0 = published, 16/4 (on 32x32: 4/2).
  config.model.patch_size = 0
  # vit: gap (mean of the tokens; big_vision's default) | tok (a class token, as in the paper) |
  # map (attention pooling: SigLIP's MAP head) | avg (class token unread, fc_norm on the patches' mean: MAE).
  config.model.pool = 'gap'
  # vit: dropout rate (after the embeddings, in the MLP, on each residual branch); efficientnet,
  # mobilenetv3: before the classifier.
  config.model.dropout = 0.0
  # vit/convnext/resnet: stochastic depth of the last block (0 at the first, linear between);
  # efficientnet/mobilenetv3: the rate all blocks approach (block i of N: rate * i / N, as timm).
  config.model.drop_path = 0.0
  # resnet: torch (symmetric, as PyTorch/timm: imported weights agree) | same (XLA's SAME; runs
  # saved before this key). efficientnet/mobilenetv3: torch (PyTorch's models) | same (TensorFlow's
  # ports, timm's tf_*: SAME padding, BatchNorm eps 1e-3).
  config.model.padding = 'torch'
  # vit: exact (erf, as timm/PyTorch) | tanh (big_vision's approximation; runs saved before this
  # key) | quick (OpenAI CLIP's QuickGELU, x * sigmoid(1.702 x)).
  config.model.gelu = 'exact'
  # convnext: floor (stride-2 downsampling drops an odd map's last row/column, as timm) | ceil (XLA's
  # SAME pads it; runs saved before this key).
  config.model.downsample = 'floor'
  # resnet18-152: True computes the 7x7 stride-2 stem as a 4x4 convolution over 2x2 blocks of pixels
  # (12 channels) on every platform, as a TPU always does (ResNet-50 compiles in 45.5 s that way
  # against 69.8 s on a v5e). The same function and weights (exact up to float rounding).
  config.model.space_to_depth = False
  # swin_t/s/b: the first this-many stages recompute their blocks' MLP branches (norm2, mlp1, GELU,
  # mlp2) in the backward pass, keeping only each branch's input: the step's widest activations.
  # Swin-T at batch 256 compiled for a v5e: 1 cuts the plan from 9.14 to 7.25 GiB for 2% more FLOPs.
  # The same function and weights; 0 keeps them all. Independent of model.remat (whole blocks).
  config.model.remat_mlps = 0
  # Compute dtype: float32 | bfloat16 | float16 (params, optimizer, BN stats stay float32; float16 trains
  # with a dynamic loss scale: an overflowing step is skipped and the scale halves, see docs/training.md).
  config.dtype = 'float32'

  # --- optimization -----------------------------------------------------
  config.batch_size = 128  # Global batch size, split over all devices and processes.
  config.eval_batch_size = -1  # Global eval batch size (-1 = batch_size).
  config.num_epochs = 5.0  # Training length in epochs (used when num_train_steps = -1).
  config.num_train_steps = -1  # Training length in steps (-1 = from num_epochs).
  # A wall-clock budget for the whole run ('90s', '30m', '2h'; '' = off), counted from the trainer's
  # start to the end of its report: a probe times the compile, warm steps, a warm evaluation and save and
  # the end report apart, and the number of steps is set so that the run ends at 97.5% of it with its
  # schedule complete; early in the run (by 25% of the steps) the loop's own time is checked once, and
  # if it is off the plan's by more than 2.5% the rest is re-planned (the schedule's remainder stretched
  # to the new last step). Replaces num_epochs/num_train_steps; a resumed run keeps its plan
  # (WORKDIR/time_budget.json).
  config.time_budget = ''

  config.optimizer = ml_collections.ConfigDict()
  # sgd | adam | adamw | lamb | lars | lion | adafactor | rmsprop (optax's) | muon |
  # schedule_free_adamw | schedule_free_sgd (optax.contrib's). A key below that the
  # chosen optimizer does not read must keep its default.
  config.optimizer.name = 'adam'
  config.optimizer.learning_rate = 1e-3  # Peak learning rate.
  config.optimizer.momentum = 0.9  # sgd/lars/rmsprop: momentum (0 = none: plain SGD).
  config.optimizer.nesterov = False  # sgd/lars/rmsprop: Nesterov momentum.
  config.optimizer.b1 = 0.9  # adam/adamw/lamb/lion: first-moment decay (lion: its interpolation).
  # adam/adamw/lamb/lion: second-moment decay (lion: its momentum's); -1 = the optimizer's own,
  # 0.999 (lion 0.99).
  config.optimizer.b2 = -1.0
  config.optimizer.eps = 1e-7  # adam/adamw/lamb/rmsprop: denominator epsilon (Keras' default).
  # lars: the trust ratio's coefficient (the update's norm is this x the kernel's, before the rate).
  config.optimizer.trust_coefficient = 0.001
  config.optimizer.decay = 0.9  # rmsprop: decay of the mean squared gradient.
  # rmsprop: divide by the gradient's variance, not its mean square.
  config.optimizer.centered = False
  # adafactor: its second moments decay by 1 - t ** -decay_rate at update t.
  config.optimizer.decay_rate = 0.8
  # adafactor: second moments as row and column means (less memory).
  config.optimizer.factored = True
  # adafactor: factor only arrays with two dimensions at least this large.
  config.optimizer.min_dim_size_to_factor = 128
  config.optimizer.clipping_threshold = 1.0  # adafactor: clip each update's RMS to this (0 = off).
  # adafactor: scale each update by its parameter's RMS (the learning rate is then relative).
  config.optimizer.multiply_by_parameter_scale = True
  # On kernels (arrays of 2+ dims) only. sgd/adam/rmsprop/lars: L2 added to the gradient; adamw,
  # lamb, lion: decoupled, x the learning rate; adafactor: decoupled, per update, not x the rate
  # (optax's weight_decay_rate).
  config.optimizer.weight_decay = 0.0
  # The same, for biases and norm scales (1-dim arrays); 0 = none, as usual.
  config.optimizer.bias_weight_decay = 0.0
  config.optimizer.grad_clip_norm = 0.0  # Clip gradients to this global norm (0 = off).
  # Gradient accumulation: average the gradients of this many consecutive batches, then update
  # once, as one batch of batch_size x accumulate_steps would (BatchNorm aside: it normalises each
  # batch by its own statistics). Steps, epochs and eval/checkpoint intervals count batches; the
  # learning-rate schedule (warmup included) counts updates. The run ends on an update; a resumed
  # run keeps its value.
  config.optimizer.accumulate_steps = 1
  # Patterns below are regexes searched in '/'-joined parameter paths
  # ('stage1_block1/Conv_0/kernel'; the classifier is 'Dense_0' in cnn/resnet, 'head' in
  # fastnet/vit/convnext). On the command line: one pattern, --config.optimizer.freeze='^stage1',
  # or a tuple, --config.optimizer.freeze="('^stage1', '^stage2')".
  # Parameters that never change (no update, no optimizer state; their BatchNorm statistics stay
  # too).
  config.optimizer.freeze = ()
  # 'regex=factor' strings: those parameters learn at factor x the rate ('^stage1=0.1'; first match
  # wins; 0 = freeze).
  config.optimizer.lr_multipliers = ()
  # 'regex=epochs' strings: those parameters stop changing after that many epochs (airbench:
  # '^stem/bias$=3').
  config.optimizer.freeze_after = ()
  # Layer-wise learning-rate decay (BEiT, timm): a parameter at depth d of a model with L layers
  # (the stem or embeddings d = 0, then each block, the head d = L) learns at layer_decay ** (L - d)
  # x the rate, times its lr_multipliers factor (0 = off; 0.65-0.75 usual for fine-tuning).
  config.optimizer.layer_decay = 0.0
  # Lookahead (Zhang et al. 2019): every `lookahead_every` updates the slow weights move
  # (1 - decay) of the way to the trained ("fast") ones, and training continues from the slow
  # weights; the last update syncs too, so the run ends on them. decay = lookahead_decay x
  # (update / total updates) ** lookahead_decay_power: power 0 is the paper's constant (decay 0.5 =
  # its alpha 0.5); airbench ramps it up (0.95**5, power 3). BatchNorm statistics follow the fast
  # weights.
  config.optimizer.lookahead_every = 0  # 0 = off; e.g. 5.
  config.optimizer.lookahead_decay = 0.5
  config.optimizer.lookahead_decay_power = 0.0
  # Sharpness-aware minimisation over any optimizer (Foret et al. 2021): the gradient at the worst point
  # within this radius of the weights, two gradient passes per step (0 = off; 0.05 is the paper's).
  config.optimizer.sam_rho = 0.0
  config.optimizer.sam_adaptive = False  # ASAM (Kwon et al. 2021): the radius scaled per weight (rho ~0.5-2).
  # muon: the peak rate of the AdamW that trains what Muon does not (biases, norm scales, the head);
  # 0 = optimizer.learning_rate.
  config.optimizer.muon_adam_lr = 0.0

  config.schedule = ml_collections.ConfigDict()
  # constant | cosine | linear | onecycle | step | exponential | rsqrt (big_vision's), over updates;
  # plateau: the peak times optax.contrib.reduce_on_plateau's scale, updated at each evaluation.
  config.schedule.name = 'constant'
  # Linear warmup from 0 (every schedule but onecycle); onecycle: its rising phase (0 = 30% of the
  # run).
  config.schedule.warmup_epochs = 0.0
  # Final LR as a fraction of the peak (cosine, linear; exponential: its floor).
  config.schedule.final_lr_fraction = 0.0
  # step: the learning rate is multiplied by `factor` at each of these epochs, e.g. (30, 60, 80);
  # plateau: by `factor` after plateau_patience evaluations without improvement (floor: final_lr_fraction).
  config.schedule.milestones = ()
  config.schedule.factor = 0.1
  # exponential: the learning rate's factor per epoch (e.g. 0.97); 0 = whatever reaches
  # final_lr_fraction at the end of the run.
  config.schedule.decay_rate = 0.0
  # rsqrt: peak / sqrt(1 + updates after warmup / timescale), big_vision's (timescale in updates).
  config.schedule.timescale = 10_000
  # rsqrt: the last epochs ramp the rate linearly down to 0 (big_vision's cooldown; 0 = none).
  config.schedule.cooldown_epochs = 0.0
  # plateau: evaluations without improvement of plateau_metric before the rate drops by `factor`.
  config.schedule.plateau_patience = 5
  # plateau: the eval metric it watches ('' = eval_loss); a *loss is minimised, others maximised.
  config.schedule.plateau_metric = ''
  config.schedule.plateau_cooldown = 0  # plateau: evaluations after a drop before counting again.

  config.label_smoothing = 0.0  # Label smoothing in [0, 1).
  # multiclass (softmax: one class per image) | multilabel (a sigmoid per class: any number of tags
  # per image, none included; needs labels with tags: dataset.labels, shards or parquet).
  config.task = 'multiclass'

  # Exponential moving average of the weights and BatchNorm statistics, updated after every
  # optimizer update: evaluated next to the raw weights (eval_accuracy_ema, ...) and saved in
  # checkpoints.
  config.ema = ml_collections.ConfigDict()
  config.ema.decay = 0.0  # 0 = off; e.g. 0.999 (about the last 1000 updates).
  # Decay min(decay, (1 + n) / (10 + n)) after n updates (TF's num_updates).
  config.ema.warmup = True

  # --- fine-tuning ------------------------------------------------------
  config.init_from = ml_collections.ConfigDict()
  # A fresh run starts from these weights ('' = off): a flaxtpu workdir or
  # WORKDIR/checkpoints/STEP, hf-hub:ORG/NAME (e.g. hf-hub:timm/resnet50.a1_in1k), a
  # timm/torchvision .safetensors/.pth/.bin or a big_vision ViT .npz. Their model (when model.name
  # is left at cnn), normalisation, image size and crop fraction become the run's defaults.
  config.init_from.checkpoint = ''
  config.init_from.step = 'latest'  # Of a workdir: latest | best | a step number.
  # Keep the source's classifier and class names (e.g. ImageNet's 1,000) instead of a fresh one for
  # the data's classes.
  config.init_from.keep_head = False
  # Regexes on parameter paths to re-initialise instead (the classifier is re-initialised anyway
  # when the classes differ).
  config.init_from.skip = ()

  # --- distillation -----------------------------------------------------
  config.distill = ml_collections.ConfigDict()
  # A frozen teacher whose predictions the model learns from ('' = off): a flaxtpu workdir or
  # WORKDIR/checkpoints/STEP, or published weights (as init_from.checkpoint). It runs in eval mode
  # inside the train step, on the same devices and in the same dtype; checkpoints hold the student.
  # It must have been trained at the student's image size (dataset.image_size, and each of
  # augment.train_sizes) on the student's classes (by name, any order): a teacher's input is never
  # resized, so another size or other classes stop the run in one line. Its normalisation may differ:
  # it sees the student's pixels normalised its own way (logged).
  config.distill.teacher = ''
  config.distill.step = 'best'  # Of a teacher workdir: best | latest | a step number.
  # soft: the teacher's probabilities at `temperature` (Hinton et al.); hard: its top class as a
  # label (DeiT); function_matching: the teacher sees the very (mixed) image the student sees
  # (Beyer et al.; pair with mixup/CutMix, alpha=1, long schedules).
  config.distill.loss = 'soft'
  # The teacher term's share of the loss: (1 - alpha) x labels' cross-entropy + alpha x T^2 x KL.
  config.distill.alpha = 0.5
  config.distill.temperature = 1.0  # Softens both distributions in the KL (soft, function_matching).

  # --- parallelism ------------------------------------------------------
  config.parallelism = 'jit'  # jit (jax.jit over a device mesh) | pmap.
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # Data-parallel axis size (-1 = all devices left after fsdp).
  config.mesh.fsdp = 1  # Shard parameters and optimizer state over this many devices.
  config.mesh.fsdp_min_size = 2**14  # Arrays with fewer elements stay replicated under fsdp.
  config.require_platform = ''  # '' = run on what is there; else tpu | gpu | cpu, or stop.
  # On CPU, split the host into this many XLA devices (~3x faster convolutions; fewer if the batch
  # sizes need); 0 = XLA's default.
  config.cpu_devices = 8
  # XLA:CPU's convolution kernels: xla (its default, YNNPACK) | eigen (faster for wide layers:
  # FastNet 1.36x, the Keras CNN 1.23x, ResNet-20 0.95x).
  config.cpu_convolutions = 'xla'

  # --- loop -------------------------------------------------------------
  config.seed = 0  # Seeds parameters, data order and augmentation.
  config.log_every_steps = 100  # Progress line and train metrics every N steps ...
  # ... and also when this many seconds passed since the last one (0 = off; one process only).
  config.log_every_secs = 0.0
  # Trace this many train steps with jax.profiler after 5 warm-up steps into WORKDIR/profile (0 =
  # off).
  config.profile_steps = 0
  # Evaluate every N steps (-1 = once per epoch; the end always evaluates).
  config.eval_every_steps = -1
  # Checkpoint every N steps (-1 = once per epoch; the end always saves).
  config.checkpoint_every_steps = -1

  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.keep = 2  # Keep the latest N checkpoints ...
  # ... plus the best by this eval metric ('' = none; auto = eval_map for task=multilabel, else
  # eval_accuracy; also eval_loss, eval_balanced_accuracy, eval_map_micro, eval_f1, each with _ema).
  config.checkpoint.best_metric = 'auto'
  config.checkpoint.best_mode = 'max'  # max | min for best_metric.
  # The once-an-epoch checkpoints (checkpoint_every_steps=-1) at least this many seconds apart (0 = every
  # epoch); an explicit checkpoint_every_steps, the last step, a stop and an early stop always save. A
  # ResNet-20 epoch on a TPU v5e took 1.16 s, and 1.82 s with a checkpoint after each (writing it slowed the
  # steps): the CIFAR recipes save at most once a minute.
  config.checkpoint.min_interval_secs = 0.0

  # Stop a run whose eval metric stopped improving: a final checkpoint, results.json, exit 0.
  config.early_stopping = ml_collections.ConfigDict()
  # '' = off; an eval metric (eval_loss, eval_accuracy, eval_map, ...); auto = checkpoint.best_metric's.
  config.early_stopping.metric = ''
  config.early_stopping.mode = 'auto'  # max | min | auto (min for a *loss, else max).
  config.early_stopping.patience = 5  # Evaluations without improvement before the run stops.
  config.early_stopping.min_delta = 0.0  # The least change that counts as an improvement.

  config.eval = ml_collections.ConfigDict()
  config.eval.checkpoint = 'latest'  # --mode=eval/predict restores: latest | best | a step number.
  # --mode=eval/predict/export (and the end-of-run report) use the EMA weights; eval.checkpoint=best
  # picks by checkpoint.best_metric, so pair it with eval_accuracy_ema.
  config.eval.ema = False
  # Every evaluation (and predict/export) averages the logits of each image and its mirror.
  config.eval.flip_tta = False
  # ... and of the image shifted this many pixels diagonally each way (weights 1/2, 1/4, 1/4; 0 =
  # off; costs 3x).
  config.eval.translate_tta = 0
  # multilabel: a tag is predicted when its probability reaches this (0 = each class's threshold
  # with the best F1 on the eval split: tuned on the split it scores, so optimistic there; saved to
  # thresholds.json by the end-of-run report and --mode=eval, which predict reads).
  config.eval.threshold = 0.0
  # Few-shot linear probes of the frozen features at every evaluation and in --mode=eval:
  # big_vision's closed-form ridge regression on `shots` train images per class, scored on the eval
  # split, logged as eval_fewshot_{K}shot (other datasets: eval_fewshot_{NAME}_{K}shot).
  config.eval.fewshot = ml_collections.ConfigDict()
  config.eval.fewshot.shots = ()  # () = off; e.g. (1, 5, 10).
  # Besides the run's own data: image folders or TFDS names, each read as NAME with its train split
  # for the probe's images and its test split (or NAME:TRAIN_SPLIT:EVAL_SPLIT) to score.
  config.eval.fewshot.datasets = ()
  config.eval.fewshot.seeds = 3  # Probe images drawn this many times per shot count; the mean is logged.
  config.eval.fewshot.l2_reg = 1024.0  # The ridge penalty on standardised features (big_vision's 2^10).

  config.predict = ml_collections.ConfigDict()
  config.predict.input = ''  # --mode=predict: an image file or a folder of images.
  config.predict.top_k = 3  # Classes printed per image.
  config.predict.output_csv = ''  # Also write predictions here ('' = print only).
  # Also write each image's Grad-CAM heatmap of its top class (NAME.npy, float32 at the image's own
  # size) and an overlay (NAME.overlay.png) into predict.explain_dir (docs/audit_explain.md).
  config.predict.explain = False
  config.predict.explain_dir = ''  # '' = WORKDIR/explain

  # --mode=audit: duplicates, leaks across splits, unreadable files and suspected wrong labels of the
  # dataset's train and eval splits -> WORKDIR/audit.json (docs/audit_explain.md).
  config.audit = ml_collections.ConfigDict()
  # Two images whose 64-bit perceptual hashes (pHash) differ in at most this many bits are near copies.
  config.audit.near_distance = 6
  config.audit.workers = 4  # Threads that read and hash the files.
  # Wrong labels are searched with out-of-fold probabilities: the images (both splits) are split into
  # this many folds (stratified; copies kept together) and each is scored by a model trained on the
  # others (0 = no search for wrong labels: duplicates, leaks and unreadable files only).
  config.audit.folds = 5
  # Each fold model trains the run's own recipe (a trained run's in the workdir: its config.json) for
  # this multiple of the run's length: of the longer of the run's own steps (num_train_steps, or
  # num_epochs over its train split, or the steps a trained run took) and num_epochs over the fold
  # model's K - 1 folds (epoch-set schedule points scaled alike). 1 (the default): each fold model is
  # at least as long as the run, so the audit costs about `folds` x the run (5x). Shorter fold models
  # can learn nothing: the audit then lists no suspects and says so (docs/audit_explain.md).
  config.audit.steps_fraction = 1.0
  # ... and at least this many epochs over its K - 1 folds, whatever the run's length: a short recipe's
  # fold models (configs/mnist.py's 3 epochs) learn too little to tell a wrong label from their own
  # mistakes (2,000 digits, 20 flipped: 12 of the 20 found at 3 epochs, 17 at 9; docs/audit_explain.md).
  # 0 = the run's length alone.
  config.audit.min_epochs = 10.0
  # Up to this many images, fold models are trained on all of them; above it, `large` decides.
  config.audit.fold_limit = 100_000
  # Over fold_limit: features (a linear probe per fold on frozen embeddings of every image: of
  # init_from.checkpoint's backbone, else of the trained run in the workdir) | sample (fold models on
  # a stratified sample of fold_limit images, which alone are scored) | auto (features when there is
  # a backbone, else sample).
  config.audit.large = 'auto'
  # Confident learning's rule (cleanlab's filter_by): prune_by_noise_rate (from the estimated noise
  # counts, the examples of largest margin) | confident_learning (another class reaches its threshold).
  config.audit.rule = 'prune_by_noise_rate'

  # --mode=calibrate: a temperature (NLL) and split-conformal prediction sets, fitted on `split` and saved
  # to WORKDIR/calibration.json, which eval, predict and export then apply (docs/calibration.md).
  config.calibrate = ml_collections.ConfigDict()
  # A split the run did not train on; slices work ('test[:50%]'). '' = the eval split (its scores then
  # become optimistic: calibrate on test[:50%] and evaluate on test[50%:] instead).
  config.calibrate.split = ''
  config.calibrate.coverage = 0.9  # Prediction sets hold the true class this often (1 - alpha).
  config.calibrate.score = 'aps'  # aps | raps (APS plus raps_lambda per rank beyond raps_k).
  # Randomised scores (U ~ Uniform(0, 1), seeded by `seed`): coverage close to the target, sets can
  # be empty; False: conservative sets that always hold the top class.
  config.calibrate.randomize = True
  config.calibrate.raps_lambda = 0.01  # RAPS: the penalty per rank beyond raps_k.
  config.calibrate.raps_k = 1  # RAPS: ranks free of penalty.

  # --mode=export (besides the SavedModel, TFLite and timm folder; docs/evaluate.md#export).
  config.export = ml_collections.ConfigDict()
  config.export.onnx = True  # Also write model.onnx, checked with onnxruntime (False = skip it).
  # Quantized TFLite models written beside model.tflite, each scored on the eval split: fp16, int8
  # (() = none, e.g. for a quick export while iterating).
  config.export.quantize = ('fp16', 'int8')
  # model_int8.tflite is kept with a warning when its eval accuracy is more than this below the
  # float TFLite model's (0.02 = 2 points).
  config.export.int8_max_drop = 0.02
  config.export.calibration_images = 300  # Train images the int8 model is calibrated on.
  config.export.hub_repo = ''  # ORG/NAME: upload export/timm and its card to the Hugging Face hub.
  config.export.license = ''  # The card's license (an SPDX id such as apache-2.0; '' = none stated).

  config.wandb = ml_collections.ConfigDict()
  # Also log to Weights & Biases in this project ('' = off; pip install 'flaxtpu[wandb]').
  config.wandb.project = ''
  config.wandb.entity = ''  # W&B team or user ('' = your default).
  # online | offline (written under WORKDIR/wandb, `wandb sync` later).
  config.wandb.mode = 'online'

  config.mlflow = ml_collections.ConfigDict()
  # Also log to this MLflow tracking server or store ('' = off; http://host:5000, sqlite:///mlflow.db;
  # pip install 'flaxtpu[mlflow]'). A server that is down or refuses never stops training.
  config.mlflow.tracking_uri = ''
  config.mlflow.experiment = 'flaxtpu'  # MLflow experiment the runs go to (created when missing).

  # Set by `python -m flaxtpu.sweep --trials=N` on each trial: the study the run reports its evaluations
  # to, so Optuna's pruner can stop it (a pruned run saves, writes results.json marked pruned, exits 0).
  config.search = ml_collections.ConfigDict()
  config.search.storage = ''  # Optuna storage URL ('' = not a trial).
  config.search.study = ''  # Study name in that storage.
  config.search.trial = -1  # Trial number in the study.

  # --mode=lr_find: an exponential learning-rate range test (WORKDIR/lr_find.json, lr_find.png).
  config.lr_find = ml_collections.ConfigDict()
  config.lr_find.min_lr = 1e-6  # The first step's rate.
  config.lr_find.max_lr = 10.0  # The last step's rate (the test stops earlier where the loss diverges).
  config.lr_find.steps = 100  # Steps from min_lr to max_lr.
  config.lr_find.smoothing = 0.98  # The loss's exponential smoothing (bias-corrected, as fastai's).
  config.lr_find.diverge_factor = 4.0  # Stop once the smoothed loss exceeds this x its minimum.

  # --- resolution (issue 41; flaxtpu/augmentation/image_sizes.py, docs/recipes.md#resolution) ---------------
  # Progressive resizing: (fraction of the training steps where it starts, size) pairs, the first at
  # 0, e.g. ((0.0, 24), (0.5, 28), (0.75, 32)): the train step resizes each augmented batch on the
  # device (antialiased) to its step's size, one compiled step per size; () = the pipeline's size
  # always. Sizes must not exceed the images the pipeline makes (dataset.image_size, or native).
  config.augment.train_sizes = ()
  # Evaluate (in training, --mode=eval, calibrate, predict, export's serving size) at this square
  # side (0 = the train size): the shorter side resized to image_size / crop_fraction, the centre
  # taken; native-size data is resized whole. FixRes: train 176, eval 224 at crop 224/232.
  config.eval.image_size = 0
  # The eval crop at eval.image_size (0 = dataset.crop_fraction's, or 1.0 for native-size data).
  config.eval.crop_fraction = 0.0

  # Stochastic weight averaging (flaxtpu/optimizers/swa.py): from swa.start on, every swa.every steps the
  # weights join a running mean, saved in checkpoints and scored at each evaluation as
  # eval_accuracy_swa, ... after its BatchNorm statistics are recomputed over train batches.
  config.swa = ml_collections.ConfigDict()
  config.swa.every = 0  # Steps between averaged weights; 0 = off (e.g. one epoch's steps).
  config.swa.start = 0.75  # The first averaged step: a fraction of the run in [0, 1), or a step number.
  # Train batches (the seed's first ones) whose statistics, averaged with equal weight (torch's
  # update_bn), become the BatchNorm statistics of averaged weights (SWA, schedule-free's x before each
  # evaluation, flaxtpu.average's soups).
  config.swa.bn_batches = 32
  # eval/predict/export and the end-of-run report use the SWA weights (as eval.ema the EMA's).
  config.eval.swa = False

  # XLA's persistent compilation cache, per user: every program a run compiles is kept, so a second run
  # of the same config compiles nothing ('' = ~/.cache/flaxtpu/jax; 'none' = off).
  config.compilation_cache_dir = ''
  # The host buffer a TPU runtime maps at its start for transfers to and from the chips, in MiB per
  # chip of the host. The runtime's own default, 4 GiB, took 6.8 s of its 7.2 s start on a TPU v5e
  # host; a batch is 38 MiB (0 = the runtime's default; TPU_PREMAPPED_BUFFER_SIZE in the environment wins).
  config.tpu_premapped_buffer_mib = 256
  config.lock()
  return config


def derived(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """A new config: `config`'s values with each dotted key of `overrides` set (a section's value, a
  ConfigDict, replaces that section with a copy of itself). `config` is never edited.

  The one way to make a second config from a run's (a teacher's), instead of a copy edited in place.
  """
  new = config.copy_and_resolve_references()
  for key, value in overrides.items():
    *sections, leaf = key.split('.')
    node = new
    for section in sections:
      node = node[section]
    is_section = isinstance(value, ml_collections.ConfigDict)
    node[leaf] = value.copy_and_resolve_references() if is_section else value
  return new
