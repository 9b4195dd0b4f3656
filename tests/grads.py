"""Gradient grab for the forked-rank Megatron training tests (recompute, tiles, recompute output).

``train_grabbing`` trains with ``megatron_metp.megatron.training.train`` and keeps, after one
step, every parameter's gradient as Megatron's DDP reduced it (``main_grad``, the shard or full
tensor this rank holds), keyed by the parameter's global name (``_global_name``: the same key in
every layout). ``differences`` compares two such runs of the same rank: worst relative errors of
the per-step losses, the grad norms and the gradients.
"""

import torch

from megatron_metp.megatron.training import _global_name, train
from tests.numerics import rel_err


def train_grabbing(size, layout, steps, state, at_step=1):
    """Train ``size`` in ``layout`` for ``steps`` steps from ``state`` (``training.setup``).

    Returns ``(records, grads)``: ``train``'s per-step records (``lm_loss``, ``grad_norm``) and
    ``{global parameter name: main_grad after step at_step}`` (fp32 clones)."""
    grads = {}

    def grab(step, st):
        if step == at_step:
            model = st["model"].module
            for pname, p in model.named_parameters():
                grads[_global_name(model, pname)] = p.main_grad.detach().clone()

    recs = train(size, layout, steps, state=state, checkpoint_fn=grab)
    return recs, grads


def run_result(recs, grads, **more):
    """The dict the tests compare: ``losses``, ``norms`` (per step), ``grads``, plus ``more``."""
    return {"losses": [r.lm_loss for r in recs], "norms": [r.grad_norm for r in recs],
            "grads": grads, **more}


def differences(a, b):
    """Worst relative differences of run ``b`` against run ``a`` (``run_result`` dicts of the
    same rank, same parameters): ``(loss, grad norm, (worst gradient name, its error),
    bit-identical gradients)``."""
    loss = max(abs(x - y) / abs(y) for x, y in zip(b["losses"], a["losses"]))
    norm = max(abs(x - y) / abs(y) for x, y in zip(b["norms"], a["norms"]))
    assert set(a["grads"]) == set(b["grads"]) and a["grads"]
    errs = {k: rel_err(b["grads"][k], a["grads"][k]) for k in a["grads"]}
    worst = max(errs, key=errs.get)
    identical = all(torch.equal(b["grads"][k], a["grads"][k]) for k in a["grads"])
    return loss, norm, (worst, errs[worst]), identical


def worst_difference(a, b):
    """The largest of ``differences``' loss, grad norm and gradient errors."""
    loss, norm, (_, grad), _ = differences(a, b)
    return max(loss, norm, grad)


def assert_same(per_rank, ref, names, tol):
    """Every rank's runs ``names`` within ``tol`` of its run ``ref`` (:func:`differences`: loss,
    gradient norm and the worst gradient), each failure naming the rank and the run."""
    for r, res in enumerate(per_rank):
        for name in names:
            loss, norm, (worst, err), _ = differences(res[ref], res[name])
            assert loss <= tol and norm <= tol and err <= tol, \
                (r, res[name]["describe"], loss, norm, worst, err)
