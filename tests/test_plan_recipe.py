"""Plans that keep the recipe (issue 41, Deliver 6): ``metp plan --reach --write-config`` and the
launch lines carry every flag of the model file's recipe (``MOE_ARGS``: the load-balancing loss
and its coefficient, the MoE layer frequency, ...), a written config states its global batch, and
``metp plan --config`` prices the iteration of the config's global batch
(``GLOBAL_BATCH_SIZE / (micro-batch × DP)`` micro-batches)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from megatron_metp.tools import cli
from megatron_metp.tools import plan as P
from tests.harness import flag_values as _flags  # Megatron argv -> {flag: [values]}

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = P.PRESETS["qwen3-30b-a3b"]
QWEN_FILE = os.path.join(REPO, "configs", "models", "qwen3-30b-a3b.sh")


def _env(**kw):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "PYTHON": sys.executable, "LC_ALL": "C.UTF-8", "MEGATRON_LM_DIR": "/m"}
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _print_cmd(config, **env):
    """``scripts/pretrain_gpt.sh --config CONFIG --print-cmd``: ``pretrain_gpt.py``'s flags."""
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config", str(config),
                           "--print-cmd"], capture_output=True, text=True, cwd=REPO,
                          env=_env(**env), timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = [x for x in proc.stdout.splitlines() if "/m/pretrain_gpt.py" in x][-1]
    argv = shlex.split(line)
    return _flags(argv[argv.index("/m/pretrain_gpt.py") + 1:])


def _bash_recipe(path):
    """The model file's ``MOE_ARGS`` as bash expands it (not as the planner parses it)."""
    proc = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\n" "${MOE_ARGS[@]}"', "_",
                           path], capture_output=True, text=True, env=_env(), timeout=30,
                          check=True)
    return _flags(proc.stdout.splitlines())


def _missing(recipe, flags):
    """The recipe's flags the launched command lacks or gives another value."""
    return {f: v for f, v in recipe.items() if flags.get(f) != v}


def test_reach_written_config_carries_the_moe_recipe_and_its_global_batch(capsys, tmp_path,
                                                                          monkeypatch):
    path = tmp_path / "best.sh"
    assert cli.main(["plan", "--reach", "--gpus", "8", "--preset", "qwen3-30b-a3b",
                     "--write-config", str(path)]) == 0
    out = capsys.readouterr().out
    recipe = _bash_recipe(QWEN_FILE)
    assert recipe["--moe-aux-loss-coeff"] == ["0.001"] and recipe["--moe-layer-freq"] == ["1"]
    flags = _print_cmd(path)
    assert _missing(recipe, flags) == {}
    # the reach's launch lines too (the METP and the stock family's)
    launches = [x for x in P.textwidth.unwrap(out).splitlines()
                if x.startswith("  best, launch: ")]
    assert len(launches) == 2
    for line in launches:
        assert "--moe-aux-loss-coeff 0.001" in line and \
            "--moe-router-load-balancing-type aux_loss" in line and "--moe-layer-freq 1" in line
    # the written config states its global batch, and metp plan --config prices that batch
    text = path.read_text()
    assert ': "${GLOBAL_BATCH_SIZE:=1}"' in text and flags["--global-batch-size"] == ["1"]
    _, job, _ = cli.build_from_argv(["--config", str(path)])
    assert job.microbatches == 1
    # negative control: a flag dropped from the recipe is caught by the comparison
    cut = [a for a in P.recipe_flags(QWEN_FILE)]
    i = cut.index("--moe-aux-loss-coeff")
    monkeypatch.setattr(P, "recipe_flags", lambda p: cut[:i] + cut[i + 2:])
    model, job, _ = cli.build_from_argv(["--config", str(path)])
    bad = tmp_path / "bad.sh"
    bad.write_text(P.config_text(QWEN.with_seq(model.seq), job, "metp", "negative control"))
    assert _missing(recipe, _print_cmd(bad)) == {"--moe-aux-loss-coeff": ["0.001"]}


def test_launch_flags_carry_every_flag_of_the_hand_written_config():
    """Every MoE flag the repo's Qwen3-30B-A3B config launches with is in the plan's flags for
    the same job, with its value."""
    hand = _print_cmd(os.path.join(REPO, "configs", "qwen3-30b-a3b-1m-metp4-cp2.sh"))
    model, job, _ = cli.build_from_argv(["--preset", "qwen3-30b-a3b", "--metp", "4", "--cp",
                                         "2", "--vocab-parallel", "--moe-token-dispatcher-type",
                                         "alltoall"])
    plan = _flags(P.megatron_flags(model, job, "metp"))
    moe = {f: v for f, v in hand.items() if f.startswith("--moe-") or f == "--num-experts"}
    assert len(moe) >= 7 and _missing(moe, plan) == {}


@pytest.mark.parametrize("global_batch,micro,expect", [(None, 1, 2), (16, 1, 4), (16, 2, 2)])
def test_config_iteration_counts_its_global_batch(capsys, tmp_path, global_batch, micro, expect):
    """GLOBAL_BATCH_SIZE / (micro-batch × DP) micro-batches per iteration (the launcher's default
    8 when the config sets none; DP 4 here: METP 2 on 8 GPUs); the printed iteration = that many
    micro-batches' time + the optimizer step (PP 1)."""
    cfg = tmp_path / "job.sh"
    cfg.write_text(f'source "{REPO}/configs/models/tiny.sh"\n: "${{SEQ_LENGTH:=4096}}"\n'
                   f': "${{METP:=2}}" "${{MICRO_BATCH_SIZE:={micro}}}"\n' +
                   (f': "${{GLOBAL_BATCH_SIZE:={global_batch}}}"\n' if global_batch else ""))
    js = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", str(cfg), "--modes", "metp", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    cost = json.loads(js.read_text())["modes"]["metp"]["cost"]
    assert cost["microbatches"] == expect
    assert abs(cost["iteration_s"] - (expect * cost["step_s"] + cost["optimizer_s"] +
                                      cost["grad_sync_s"])) <= \
        1e-9 * cost["iteration_s"]
    assert f"({expect} micro-batches)" in out


def test_config_global_batch_must_divide():
    with pytest.raises(ValueError, match="GLOBAL_BATCH_SIZE=3 in the config"):
        P.microbatches(3, 1, 2)
    assert P.microbatches(8, 2, 2) == 2


def _launch(line):
    """A launch line (``VAR=value ... scripts/pretrain_gpt.sh --config FILE``) run with
    ``--print-cmd``: ``pretrain_gpt.py``'s flags."""
    words = shlex.split(line)
    i = words.index("scripts/pretrain_gpt.sh")
    env = dict(w.split("=", 1) for w in words[:i])
    return _print_cmd(words[i + 2], **env)


def test_a_config_plans_launch_line_keeps_the_recipe(tmp_path, monkeypatch):
    """``metp plan --config`` of a MoE job that does not fit: the fit hint's launch line sources
    the model file the config sources (its norm, RoPE base, biases) and carries its MoE recipe,
    and its VOCAB_SIZE is the tokenizer's (the plan's end-of-document token not added twice).
    Negative control: without the model file (the old launch through configs/models/tiny.sh) the
    recipe and the model's flags are gone."""
    cfg = tmp_path / "qwen-norecompute.sh"
    cfg.write_text(f'source "{QWEN_FILE}"\n: "${{SEQ_LENGTH:=1048576}}"\n'
                   ': "${METP:=4}" "${CP:=2}" "${TP:=1}"\n: "${METP_VOCAB_PARALLEL:=1}"\n'
                   'EXTRA_ARGS=("${MOE_ARGS[@]}")\n')
    model, job, modes = cli.build_from_argv(["--config", str(cfg)])
    hint = P.plan(model, job, modes)["modes"]["metp"]["fit_hint"]
    assert hint and "full" in hint["flags"]  # it fits with recompute (and more)
    hand = _print_cmd(cfg)
    flags = _launch(hint["pretrain_gpt_sh"])
    recipe = _bash_recipe(QWEN_FILE)
    assert _missing(recipe, flags) == {}
    for flag in ("--normalization", "--rotary-base", "--vocab-size", "--disable-bias-linear",
                 "--qk-layernorm", "--num-query-groups", "--kv-channels"):
        assert flags.get(flag) == hand.get(flag), flag
    assert flags["--recompute-granularity"] == ["full"]
    assert _missing(recipe, _flags(hint["megatron_lm_args"])) == {}
    monkeypatch.setattr(P.launch, "model_file", lambda m: None)
    bare = P.launch.launch_line(model, job, "metp")
    assert "--moe-aux-loss-coeff" not in bare and "configs/models/tiny.sh" in bare
