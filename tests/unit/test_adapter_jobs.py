"""A :class:`LoadJob` crosses process boundaries pickled (vLLM's ``StepMeta``, the
reference engine's rank messages): its checked block tables arrive checked and read-only,
and tables nobody checked arrive unchecked."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from kvbridge.adapter import LoadJob, edge_tables, state_tables
from kvbridge.api import PlanError, Tables, checked_tables

LIMITS = (10, 10)


def test_a_sealed_table_stays_sealed_and_read_only_when_pickled() -> None:
    tabs = checked_tables([[1, 2, 3], np.array([0, 9])], LIMITS, "D")
    job = pickle.loads(pickle.dumps(LoadJob("r", "h", tabs, 0)))
    back = job.tables
    assert back.lists() == [[1, 2, 3], [0, 9]] and back.limits == LIMITS
    assert checked_tables(back, LIMITS, "D") is back  # trusted as it is: not checked again
    assert checked_tables(back, (20, 20), "D") is back  # checked against fewer blocks
    for t in back.ids:
        assert t.dtype == np.int64 and not t.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            t[0] = 5


def test_an_unsealed_table_stays_unsealed_when_pickled() -> None:
    loose = Tables((np.array([1, 9], np.int64), np.array([2], np.int64)), LIMITS)
    back = pickle.loads(pickle.dumps(loose))
    assert checked_tables(back, LIMITS, "D") is not back  # checked now
    forged = Tables((np.array([1, 99], np.int64), np.array([2], np.int64)), LIMITS)
    with pytest.raises(PlanError, match="table 0 holds block 99, outside"):
        checked_tables(pickle.loads(pickle.dumps(forged)), LIMITS, "D")


def test_the_state_slot_cut_keeps_a_sealed_table_sealed() -> None:
    tabs = checked_tables([[0, 0, 7, 9], [1, 2, 3, 4]], LIMITS, "D")
    cut = state_tables(tabs, {0: 32}, "align", 96)
    assert cut.lists() == [[7], [1, 2, 3, 4]]
    assert checked_tables(cut, LIMITS, "D") is cut
    assert state_tables(tabs, {0: 32}, "align", 40).lists()[0] == []  # a null block
    forged = Tables(tabs.ids, LIMITS)
    assert checked_tables(state_tables(forged, {0: 32}, "align", 96), LIMITS, "D") is not cut


def test_a_pickle_whose_ids_break_the_seal_comes_back_unsealed() -> None:
    """A pickle is bytes anyone may have made: the seal holds only if the ids still do."""
    tabs = checked_tables([[1, 2, 3], [4]], LIMITS, "D")
    blob = pickle.dumps(tabs)
    tampered = blob.replace(
        np.array([1, 2, 3], np.int64).tobytes(), np.array([1, 2, 99], np.int64).tobytes()
    )
    assert tampered != blob
    back = pickle.loads(tampered)
    with pytest.raises(PlanError, match="table 0 holds block 99, outside"):
        checked_tables(back, LIMITS, "D")
    negative = pickle.loads(
        blob.replace(np.array([4], np.int64).tobytes(), np.array([-1], np.int64).tobytes())
    )
    with pytest.raises(PlanError, match="table 1 holds block -1"):
        checked_tables(negative, LIMITS, "D")


def test_edge_tables_checks_once_and_lets_refused_ids_reach_the_rank_unsealed() -> None:
    good = edge_tables([[1, 2], [3]], LIMITS, "D")
    assert checked_tables(good, LIMITS, "D") is good
    for bad in ([[1, 12], [3]], [[1, -2], [3]], [[1, 2**70], [3]]):
        tabs = edge_tables(bad, LIMITS, "D")  # no raise here: the load fails at the rank
        with pytest.raises(PlanError):
            checked_tables(tabs, LIMITS, "D")


def test_a_state_group_beyond_the_tables_is_left_for_the_ranks_count_check() -> None:
    tabs = checked_tables([[1, 2]], (10,), "D")
    cut = state_tables(tabs, {1: 32}, "none", 10)
    with pytest.raises(PlanError, match="need 2 block tables"):
        checked_tables(cut, LIMITS, "D")
