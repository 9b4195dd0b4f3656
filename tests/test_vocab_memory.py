"""``benchmarks/vocab_memory.py`` at a tiny size: the measurement machinery and its claims.

Runs the benchmark's own ``run`` (fake process group + FakeTensorMode + MemTracker, one worker
process per ``p``) for V=4000, s=2048, h=32, p ∈ {2, 4} and checks that the METP vocabulary path
holds less than both Megatron TP+SP and replicated METP, that its largest tensor is within the
``[s/p·b, V/p]`` fp32 logits bound and that no tensor of it spans the full vocabulary — while the
replicated path, the negative control, is caught holding full-vocabulary tensors — and that METP's
peak falls faster than 1/p from p=2 to p=4 (logits per rank go as 1/p²).
"""

from benchmarks.vocab_memory import MiB, check_row, make_cases, padded_vocab, run, _vocab_axes

VOCAB, SEQ, HIDDEN, PS = 4000, 2048, 32, (2, 4)


def test_vocab_memory_tiny():
    cases = make_cases(vocabs=[VOCAB], seqs=[SEQ], ps_=list(PS), hidden=HIDDEN)
    rows = run(cases, jobs=2, timeout=120)
    assert len(rows) == 3 * len(PS)
    for r in rows:
        assert "error" not in r, r.get("traceback", r.get("error"))
    by = {(r["p"], r["path"]): r for r in rows}
    for p in PS:
        metp, tp, rep = by[p, "metp-vocab"], by[p, "tp-sp"], by[p, "metp-replicated"]
        V = padded_vocab(VOCAB, "metp-vocab", p)
        assert metp["V_padded"] == V and V % (128 * p) == 0
        assert metp["tables_mib"] == 2 * (V // p) * HIDDEN * 2 / MiB
        assert metp["peak_mib"] < tp["peak_mib"] and metp["peak_mib"] < rep["peak_mib"]
        # the claims, and the script's own check of them
        assert metp["largest"]["mib"] <= metp["logits_bound_mib"]
        assert metp["logits_bound_mib"] == (SEQ // p) * (V // p) * 4 / MiB
        assert metp["vocab_width"] == V // p and metp["full_vocab_tensors"] == 0
        assert check_row(metp) == []
        # stock TP shards the vocabulary too, but holds the whole sequence's logits
        assert tp["vocab_width"] == V // p and tp["full_vocab_tensors"] == 0
        assert tp["largest"]["shape"] == [SEQ, 1, V // p]
        assert tp["largest"]["mib"] > metp["logits_bound_mib"]
        # negative control: the replicated path holds [V, h] tables and [s/p, b, V] logits
        assert rep["vocab_width"] == rep["V_padded"] and rep["full_vocab_tensors"] >= 6
        assert rep["largest"]["shape"] == [SEQ // p, 1, rep["V_padded"]]
        assert check_row(dict(rep, path="metp-vocab"))
    assert by[4, "metp-vocab"]["peak_mib"] < 0.5 * by[2, "metp-vocab"]["peak_mib"]


def test_vocab_axes_from_twin_runs():
    V, h, p, step = 1024, 64, 4, 512  # step = 128·p
    v = V // p
    a = [("param", [v, h], "bf16", 0), ("mm", [300, v], "f32", 0), ("zeros", [v * h], "f32", 0),
         ("mm", [300, V], "f32", 0), ("zeros", [V * h], "f32", 0), ("x", [300, h], "f32", 0)]
    b = [("param", [v + 128, h], "bf16", 0), ("mm", [300, v + 128], "f32", 0),
         ("zeros", [(v + 128) * h], "f32", 0), ("mm", [300, V + step], "f32", 0),
         ("zeros", [(V + step) * h], "f32", 0), ("x", [300, h], "f32", 0)]
    axes = _vocab_axes(a, b, V, step, p)
    assert [(x[1], rows, full) for x, rows, full in axes] == [
        ([v, h], v, False), ([300, v], v, False), ([v * h], None, False),
        ([300, V], V, True), ([V * h], None, False)]
    try:
        _vocab_axes(a, b[:-1], V, step, p)
    except RuntimeError:
        pass
    else:
        raise AssertionError("mismatched twin runs must be refused")
