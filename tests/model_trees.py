"""The model tree (modules, parameter shapes, digest: ``megatron_metp.megatron.build.model_tree``)
of one METP model as each place that builds it reports it: a Megatron-LM training log (the
``METP model:`` line of ``build_metp_gpt``), the dry run's JSON report and ``metp measure``."""

import re

_LINE = re.compile(r"^METP model: (.+)$", re.M)


def in_log(log: str) -> str:
    """The tree of the first model a Megatron-LM training log built (rank 0's line)."""
    found = _LINE.findall(log)
    assert found, "no 'METP model:' line in the training log"
    return found[0].strip()


def of_dry_run(megatron_lm_dir: str, config: str, **env) -> dict:
    """The dry run's report (``model_tree``, ``padded_vocab_size``, ...) of ``config`` through
    scripts/pretrain_gpt.sh (:func:`megatron_metp.tools.agreement.dry_run`); ``env`` overrides
    the config's variables."""
    from megatron_metp.tools.agreement import dry_run

    return dry_run(config, megatron_lm_dir, env={k: str(v) for k, v in env.items()})


def of_measure(model, job, mode: str = "metp") -> str:
    """The tree ``metp measure`` builds for ``model`` and ``job`` (one forked fake rank)."""
    from megatron_metp.tools import fakerank as FR
    from megatron_metp.tools import measure as M

    FR.preload_megatron()
    return FR.run_isolated(lambda: M.measure_here(model, job, mode), timeout=300)["model_tree"]
