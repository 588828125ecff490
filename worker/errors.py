"""The one error type a bad checkpoint raises, so entry points print one clear line."""


class CheckpointError(ValueError):
    """A checkpoint directory that Sluice cannot run: missing file, tensor, shape or architecture."""
