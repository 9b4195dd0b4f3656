"""tests/file_order.py: the workers take the heaviest files first, each file's tests in order."""

from types import SimpleNamespace

import pytest

from tests import file_order, markers


def _item(nodeid, fixtures=(), megatron_lm=False):
    mark = pytest.mark.megatron_lm.mark if megatron_lm else None
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures),
                           get_closest_marker=lambda name: mark if name == "megatron_lm" else None)


def test_heavy_files_go_first_and_each_file_keeps_its_order():
    fixture = next(iter(markers.SLOW_FIXTURES))
    fx_file, fx_name = fixture.split("::")
    # a test listed with its time, in another file
    slow = next(e for e in markers.SLOW if "[" not in e and not e.startswith(fx_file))
    items = ([_item(f"tests/test_many.py::test_{i}") for i in range(10)]  # 10 light tests
             + [_item(slow)]
             + [_item(f"{fx_file}::test_a", [fx_name]), _item(f"{fx_file}::test_b", [fx_name])]
             + [_item("tests/test_launch.py::test_x", megatron_lm=True)])
    weights = file_order.file_weights(items)
    assert weights["tests/test_many.py"] == pytest.approx(10 * file_order.OTHER_S)
    assert weights[slow.split("::")[0]] == markers.SLOW[slow]
    # the module fixture once, not once per test using it
    assert weights[fx_file] == pytest.approx(markers.SLOW_FIXTURES[fixture] +
                                             2 * file_order.OTHER_S)
    assert weights["tests/test_launch.py"] == file_order.LAUNCH_S
    ordered = [i.nodeid for i in file_order.heaviest_first(items)]
    files = list(dict.fromkeys(n.split("::")[0] for n in ordered))
    assert files == sorted(weights, key=lambda f: -weights[f])
    assert files[-1] == "tests/test_many.py"  # most tests, least time: last (xdist put it first)
    assert [n for n in ordered if n.startswith("tests/test_many.py")] == \
        [f"tests/test_many.py::test_{i}" for i in range(10)]
    assert sorted(ordered) == sorted(i.nodeid for i in items)  # nothing lost or repeated
