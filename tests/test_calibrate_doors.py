"""scripts/calibrate_doors.py's selection rule, fixed before the runs, by hand."""

from tests.helpers import load_script

calibrate = load_script("calibrate_doors")


def _id(success, partial):
    return {"id": {"success": success, "partial_groups": partial}}


def test_the_candidate_nearest_the_middle_of_the_range_with_enough_partial_groups_is_chosen():
    results = {"shots2-4": _id(0.351, 0.66), "shots2-3": _id(0.391, 0.70), "shots3-4": _id(0.31, 0.40),
               "shots0-4": _id(0.06, 0.10)}
    assert calibrate.choose(results) == "shots2-4"  # |0.351 - 0.325| < |0.391 - 0.325|; shots3-4 too few partial
    assert calibrate.choose({"a-3": _id(0.45, 0.9), "b-3": _id(0.2, 0.9)}) is None  # none in [0.25, 0.40]
    assert calibrate.task_of("shots3-5").rooms == 5 and calibrate.task_of("shots3-5").shots == 3
    assert calibrate.task_of("shots3-5").ood_rooms == 7
