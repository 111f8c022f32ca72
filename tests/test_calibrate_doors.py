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


def test_the_rule_larger_candidates_and_setting_the_chosen_one_in_the_task_config(tmp_path):
    import shutil

    import yaml

    larger = [c for c in calibrate.CANDIDATES if c.startswith("larger")]
    assert len(larger) == 12 and "larger1-shots3-2" in larger and "larger2-shots4-3" in larger
    task = calibrate.task_of("larger2-shots4-3")
    assert (task.rule, task.digits, task.ood_digits, task.shots, task.rooms, task.ood_rooms) == \
        ("larger", 2, 3, 4, 3, 5)
    config = tmp_path / "doors_mixed.yaml"
    shutil.copy("configs/replication/doors_mixed.yaml", config)
    before = config.read_text()
    calibrate.set_candidate(str(config), "mixed2-shots2-3")
    after = yaml.safe_load(config.read_text())["data"]["source"]["init_args"]
    assert after == {"rule": "mixed", "rooms": 3, "digits": 2, "shots": 2, "ood_rooms": 5}
    assert [line for line in config.read_text().splitlines() if line.startswith("#")] == \
        [line for line in before.splitlines() if line.startswith("#")]  # the comments kept
    import pytest

    with pytest.raises(SystemExit, match="sets no DoorsTask rule 'named'"):
        calibrate.set_candidate(str(config), "shots2-4")
