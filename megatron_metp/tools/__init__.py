"""The tools users run: ``metp plan`` (:mod:`.plan`), ``metp measure`` (:mod:`.measure`), the
Megatron-LM dry run (:mod:`.dry_run`), the demo (:mod:`.demo`), the TP comparison
(:mod:`.compare`), the ``metp`` command line (:mod:`.cli`) and the fake-rank harness they share
(:mod:`.fakerank`).

Layers of the package: the METP algorithm (``megatron_metp.ops``, ``ring``, ``groups``), the
Megatron integration (``megatron_metp.megatron``, ``megatron_lm``, ``cpu``), and these tools.
"""
