"""The one exception of :mod:`megatron_metp.megatron.checkpoint` (imported from there)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says why and names the file."""

    #: the message already names the ranks and files (the watchdog does not diagnose it again)
    names_ranks = True
