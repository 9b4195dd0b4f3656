"""The one exception of :mod:`megatron_metp.megatron.checkpoint` (imported from there)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says why and names the file."""

    #: read by megatron_metp.runtime.watchdog.is_transport_error (the layer below cannot import
    #: this class): the message already names the ranks (checkpoint_agreement)
    names_ranks = True
