"""How ``--dist loadgroup`` hands tests to the two workers (tests/conftest.py): the tests that share a module
fixture's work as one unit, every other test alone."""

from types import SimpleNamespace

from conftest import SHARED, pytest_xdist_make_scheduler, scheduling_unit


def test_the_tests_that_share_a_fixture_are_one_unit_of_their_file():
    assert scheduling_unit("tests/test_planner.py::test_with_a_small_budget_x") == "tests/test_planner.py::shared"
    assert scheduling_unit("tests/test_predict.py::test_advisor_recommendation_fits_x[20.0]") == (
        "tests/test_predict.py::shared")
    assert scheduling_unit("tests/test_attention.py::test_any[1]") == "tests/test_attention.py::shared"  # whole file


def test_every_other_test_is_a_unit_of_its_own():
    for nodeid in ("tests/test_planner.py::test_bytes_per_parameter_table", "tests/test_cli.py::test_x[a]",
                   "tests/test_predict.py::test_the_vits_bf16_runs_are_predicted_within_the_bound[amp]"):
        assert scheduling_unit(nodeid) == nodeid


def test_the_shared_groups_name_files_of_this_suite():
    assert all(name.startswith("test_") and name.endswith(".py") for name in SHARED)


def test_other_distribution_modes_keep_xdists_scheduler():
    for dist in ("load", "loadfile", "no"):
        assert pytest_xdist_make_scheduler(SimpleNamespace(getvalue=lambda key, mode=dist: mode), None) is None
