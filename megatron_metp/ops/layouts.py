"""The names of the token layouts of a METP group (torch-free: the launcher's preflight checks
``--metp-packed-layout`` against them): which tokens each is is in :mod:`.sequence` (plain
sequences) and :mod:`.documents` (packed documents)."""

#: ``dual_chunk`` (Megatron's context-parallel order) and ``contiguous`` (:mod:`.sequence`)
LAYOUTS = ("dual_chunk", "contiguous")

#: Layouts of a packed sequence: the plain ones and ``balanced`` (long documents dual-chunked
#: on their own, the rest dual-chunked together).
PACKED_LAYOUTS = LAYOUTS + ("balanced",)
