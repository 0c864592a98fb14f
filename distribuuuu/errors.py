"""Every error a user may meet, and the exit codes the tools end with.

The classes carry no logic: a message written for users, one line, naming
the key, file or process at fault. Which error ends which tool with which
code is said once, in :mod:`distribuuuu.cli`. Nothing here imports torch.
"""

from __future__ import annotations

# Exit codes shared by the tools (train_net.py --help lists them all).
EXIT_OK = 0
EXIT_FAILED = 1  # the work failed
EXIT_UNUSABLE_INPUT = 2  # refused before anything was written
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


# --------------------------------------------------------------------------- #
# Refused inputs: a config, a launch, a data set, a checkpoint, an output path.
# --------------------------------------------------------------------------- #
class ConfigError(ValueError):
    """A config value, key or file that cannot be used; the message is one line."""


class OutDirInUseError(ConfigError):
    """Another live process holds the lock of OUT_DIR."""


class DeferredRefusalError(ConfigError):
    """An input that rank 0 alone refused before the process group existed,
    raised on every rank once they joined it (exit 2, nothing written)."""


class LaunchError(ValueError):
    """The environment describes a launch that cannot work (e.g. srun forgotten)."""


class DataError(ValueError):
    """A data set, folder or file that cannot be used; the message names it."""


class UnreadableImageError(DataError):
    """The image of a sample cannot be decoded (DATA.SKIP_CORRUPT may skip it)."""


class CheckpointError(ValueError):
    """A weights file that cannot be used; the message is one line naming it."""


class RefusedCheckpointError(ValueError):
    """A file that would build objects or reach files a checkpoint never does."""


class DamagedCheckpointError(ValueError):
    """A checkpoint that is incomplete, truncated or fails its checksums."""


class ZipLayoutError(ValueError):
    """A zip whose parts two readers could place differently."""


class OnnxError(ValueError):
    """An ONNX export or file that cannot be used; one line saying why."""


class OutputPathError(ValueError):
    """An output path that writing would destroy: a device, FIFO, folder or
    link, or a file that is also an input or another output."""


class UnsplittableModelError(ValueError):
    """A model the pipeline does not know how to run as a chain of steps."""


# --------------------------------------------------------------------------- #
# Failures while running: the job, the disk, the numbers, an export.
# --------------------------------------------------------------------------- #
class DistributedSetupError(RuntimeError):
    """The process group could not be formed (peers missing, port taken, ...)."""


class PeerLostError(RuntimeError):
    """A collective failed because other processes of the job stopped answering."""


class LoaderTimeoutError(RuntimeError):
    """No batch came from a loader within DATA.TIMEOUT seconds."""


class DiskFullError(RuntimeError):
    """No space left while writing a file; the message names it."""


class NoMicroBatchFitsError(RuntimeError):
    """TRAIN.MICRO_BATCH auto's probe ran out of memory at a micro-batch of 1
    on some rank: the model does not fit, however the batch is split."""


class StepOutOfMemoryError(RuntimeError):
    """A training step ran out of device memory on this rank, which stops
    at once (its peers may wait in a collective it will never join); only
    this rank knows, so it says it itself."""


class NonFiniteError(RuntimeError):
    """The training loss or the weights became NaN or infinite; the run stops
    and nothing non-finite is saved."""


class MismatchError(RuntimeError):
    """An exported artefact whose outputs differ from the eager model's."""
