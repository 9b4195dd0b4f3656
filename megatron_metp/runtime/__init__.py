"""The runtime under the METP ops: explicit process groups (:mod:`.groups`), the double-buffered
ring exchange (:mod:`.ring`), the one timeout and stalled-rank naming (:mod:`.watchdog`), the
cross-rank agreement check (:mod:`.agree`), the finite check (:mod:`.finite`), the METP × CP
sequence ring (:mod:`.context`) and host offload of
saved activations (:mod:`.offload`); the documented ``METP_*`` overrides, read only in
:mod:`.overrides`. Nothing here imports megatron-core or the ops."""
