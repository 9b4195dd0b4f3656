"""The one exception of :mod:`megatron_metp.megatron.checkpoint` (imported from there)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says why and names the file."""
