"""The order in which ``make test``'s workers take the test files: the heaviest first.

``pytest -n 2 --dist loadfile --no-loadscope-reorder`` (Makefile ``XDIST``) hands the files to
the two workers in collection order, a worker taking the next file when it has two tests left.
Left to itself, pytest-xdist (3.8) orders the files by their number of tests, which puts the
one-test files last, among them some of the longest (a 50 s measurement, a Megatron-LM import
and training): one worker then runs them while the other has nothing left. Longest first
(:func:`heaviest_first`) leaves the short files for the end, where they even out the two
workers' finishing times.

A file's weight is an estimate from what tests/markers.py already records: each test's time in
``SLOW`` (the tests over 5 s without Megatron-LM), ``LAUNCH_S`` for each test that uses a
Megatron-LM checkout (a ``pretrain_gpt.py`` launch or dry run, 5-60 s), the module fixtures of
``SLOW_FIXTURES`` once per file, and ``OTHER_S`` for every other test. Only the order changes:
every test still runs, each file on one worker (tests/leak_guard.py keeps them independent of
the order).
"""

from collections import defaultdict

import pytest

from tests import markers

#: seconds (2 cores, the CI legs' --durations) assumed for a test using a Megatron-LM checkout
LAUNCH_S = 15.0
#: seconds assumed for any other test not listed in markers.SLOW
OTHER_S = 0.3


def _test_s(item) -> float:
    node = item.nodeid
    for entry, seconds in markers.SLOW.items():
        if markers.matches(node, (entry,)):
            return seconds
    return LAUNCH_S if item.get_closest_marker("megatron_lm") else OTHER_S


def file_weights(items) -> dict:
    """``{file: estimated seconds}`` of the collected ``items``."""
    weight = defaultdict(float)
    fixtures = defaultdict(set)
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        weight[path] += _test_s(item)
        fixtures[path] |= {f for f in getattr(item, "fixturenames", ())
                           if f"{path}::{f}" in markers.SLOW_FIXTURES}
    for path, names in fixtures.items():
        weight[path] += sum(markers.SLOW_FIXTURES[f"{path}::{f}"] for f in names)
    return dict(weight)


def heaviest_first(items) -> list:
    """``items`` with the files in decreasing :func:`file_weights` (ties in collection order),
    each file's tests in their own order."""
    weight = file_weights(items)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)
    return sorted(items, key=lambda it: (-weight[it.nodeid.split("::", 1)[0]],
                                         first[it.nodeid.split("::", 1)[0]]))


class HeaviestFilesFirst:
    """The plugin tests/conftest.py registers: orders the tests left after ``-m`` / ``-k``
    (trylast: after the deselection and the markers)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items[:] = heaviest_first(items)
