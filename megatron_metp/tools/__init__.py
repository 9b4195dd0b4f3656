"""The tools users run: ``metp plan`` (:mod:`.plan`), ``metp measure`` (:mod:`.measure`), the
Megatron-LM dry run (:mod:`.dry_run`), the demo (:mod:`.demo`), the TP comparison
(:mod:`.compare`), the ``metp`` command line (:mod:`.cli`) and the fake-rank harness they share
(:mod:`.fakerank`).

Layers of the package, each importing only those below it: ``megatron_metp.runtime`` (groups,
ring, watchdog, agreement, finite, offload) < ``megatron_metp.ops`` < ``megatron_metp.megatron``
(megatron-core integration and its CPU shims) < ``megatron_metp.megatron_lm`` (the Megatron-LM
hooks, CPU runner, resume checks) < these tools.
"""
