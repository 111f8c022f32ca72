import json

import pytest

from scgrpo.errors import InputError
from scgrpo.data import ArithmeticTask, CountdownTask, FileSource, HubDataset, PromptDataModule, PromptStream, resolve_source
from scgrpo.verifiers import CountdownVerifier, NumericVerifier


def test_arithmetic_splits_are_disjoint_deterministic_and_correct():
    task = ArithmeticTask(num_eval=64, num_ood=32)
    train, ident, ood = task.rows("train"), task.rows("id"), task.rows("ood")
    assert len(ident) == 64 and len(ood) == 32 and len(train) == 90 * 90 - 64
    train_q = {r["question"] for r in train}
    assert not train_q & {r["question"] for r in ident}
    assert all(10 <= int(q) <= 99 for r in train[:50] for q in r["question"].split("?")[0].split()[2::2])
    assert all(100 <= int(n) <= 999 for r in ood for n in r["question"].split("?")[0].split()[2::2])
    for row in ident + ood:
        a, _, b = row["question"].removeprefix("What is ").split("?")[0].split()
        assert row["answer"] == int(a) + int(b)
    assert ArithmeticTask(num_eval=64).rows("id") == ident  # same seed, same split
    assert ArithmeticTask(num_eval=64, seed=7).rows("id") != ident


def test_arithmetic_other_operations():
    rows = ArithmeticTask(operations=("-", "*"), num_eval=10).rows("id")
    for row in rows:
        a, op, b = row["question"].removeprefix("What is ").split("?")[0].split()
        assert row["answer"] == (int(a) - int(b) if op == "-" else int(a) * int(b))
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTask(operations=("/",))


def test_arithmetic_ood_alternates_unseen_lengths_and_unseen_operations():
    plain = ArithmeticTask(operations=("+", "-"), num_eval=16, num_ood=20)
    mixed = ArithmeticTask(operations=("+", "-"), ood_operations=("*",), num_eval=16, num_ood=20)
    assert mixed.rows("train") == plain.rows("train") and mixed.rows("id") == plain.rows("id")
    parsed = [row["question"].removeprefix("What is ").split("?")[0].split() for row in mixed.rows("ood")]
    for i, ((a, op, b), row) in enumerate(zip(parsed, mixed.rows("ood"))):
        if i % 2:  # trained length, unseen operation
            assert op == "*" and 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and row["answer"] == int(a) * int(b)
        else:  # unseen length, trained operations
            assert op in "+-" and 100 <= int(a) <= 999 and 100 <= int(b) <= 999
            assert row["answer"] == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert {op for _, op, _ in parsed[::2]} == {"+", "-"}
    with pytest.raises(ValueError, match="unseen"):
        ArithmeticTask(operations=("+", "-"), ood_operations=("-",))
    with pytest.raises(ValueError, match="ood_operations"):
        ArithmeticTask(ood_operations=("/",))


def test_countdown_problems_are_well_formed():
    task = CountdownTask(num_train=50, num_eval=8)
    for row in task.rows("train") + task.rows("ood"):
        assert 0 < row["answer"]["target"] <= 1000
        assert str(row["answer"]["target"]) in row["question"]
    assert len(task.rows("ood")[0]["answer"]["numbers"]) == 4
    assert isinstance(task.default_verifier(), CountdownVerifier)
    # a problem built from a single addition is solvable by that addition
    row = {"target": 7, "numbers": [3, 4]}
    assert CountdownVerifier().verify("<answer>3 + 4</answer>", row).score == 1.0


def test_unknown_task_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown task 'arithmetik'.*arithmetic"):
        resolve_source("arithmetik")


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_file_source_maps_columns_and_skips_bad_rows(tmp_path, caplog):
    path = _write_jsonl(
        tmp_path / "train.jsonl",
        [{"problem": "1+1?", "solution": 2, "uid": "a"}, {"problem": "", "solution": 3, "uid": "b"},
         {"problem": "2+2?", "solution": None, "uid": "c"}, {"problem": "3+3?", "solution": 6, "uid": "d"}],
    )
    source = FileSource(path, columns={"question": "problem", "answer": "solution", "id": "uid"})
    rows = source.rows("train")
    assert rows == [{"id": "a", "question": "1+1?", "answer": 2, "columns": {"solution": 2, "uid": "a"}},
                    {"id": "d", "question": "3+3?", "answer": 6, "columns": {"solution": 6, "uid": "d"}}]
    assert "skipped 2 of 4 rows" in caplog.text and "(first: row 2: an empty prompt)" in caplog.text
    assert isinstance(source.default_verifier(), NumericVerifier)


def test_file_source_reads_csv_and_parquet(tmp_path):
    import pandas as pd

    frame = pd.DataFrame({"question": ["a?", "b?"], "answer": ["1", "2"]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        rows = FileSource(str(tmp_path / name)).rows("train")
        assert [r["question"] for r in rows] == ["a?", "b?"] and [r["id"] for r in rows] == ["0", "1"]


def test_missing_column_is_a_clear_error(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"q": "x", "a": 1}])
    with pytest.raises(ValueError, match="no column 'question'.*columns: \\['q', 'a'\\]"):
        FileSource(path).rows("train")


def test_empty_dataset_is_a_clear_error(tmp_path):
    import pandas as pd

    pd.DataFrame({"question": [], "answer": []}).to_csv(tmp_path / "empty.csv", index=False)
    with pytest.raises(ValueError, match="empty"):
        FileSource(str(tmp_path / "empty.csv")).rows("train")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        FileSource(str(tmp_path / "nope.jsonl"))


def test_hub_dataset_loads_a_local_folder_in_hub_layout(tmp_path):
    """load_dataset(name) on a folder with data/train-*.jsonl works as it does for a hub id."""
    folder = tmp_path / "gsm8k-like" / "data"
    folder.mkdir(parents=True)
    _write_jsonl(folder / "train-00000.jsonl", [{"question": f"q{i}", "answer": f"work #### {i}"} for i in range(5)])
    _write_jsonl(folder / "test-00000.jsonl", [{"question": "t", "answer": "#### 9"}])
    source = HubDataset(str(tmp_path / "gsm8k-like"))
    assert [r["question"] for r in source.rows("train")] == [f"q{i}" for i in range(5)]
    assert source.rows("test")[0]["answer"] == "#### 9"
    assert source.eval_splits() == ["test"]
    assert NumericVerifier().verify("so 9", source.rows("test")[0]["answer"]).score == 1.0


def test_prompt_stream_is_deterministic_resumable_and_rank_split():
    rows = [{"id": str(i), "question": f"q{i}", "answer": i} for i in range(10)]
    stream = iter(PromptStream(rows, batch_size=3, seed=0))
    batches = [next(stream).ids for _ in range(7)]
    assert len({tuple(b) for b in batches}) == 7
    assert sorted(sum(batches[:3], [])) == sorted(set(sum(batches[:3], [])))  # no repeats within an epoch
    resumed = iter(PromptStream(rows, batch_size=3, seed=0, start_batch=4))
    assert [next(resumed).ids for _ in range(3)] == batches[4:7]
    other_seed = iter(PromptStream(rows, batch_size=3, seed=1))
    assert next(other_seed).ids != batches[0]
    r0 = iter(PromptStream(rows, batch_size=2, seed=0, rank=0, world_size=2))
    r1 = iter(PromptStream(rows, batch_size=2, seed=0, rank=1, world_size=2))
    first0, first1 = next(r0).ids, next(r1).ids
    assert not set(first0) & set(first1)


def test_datamodule_eval_splits_and_state():
    dm = PromptDataModule("arithmetic", batch_size=4, eval_batch_size=16, eval_splits=["id"], max_eval_prompts=20)
    loaders = dm.val_dataloader()
    batches = list(loaders[0])
    assert [len(b) for b in batches] == [16, 4] and batches[0].split == "id"
    dm.batches_consumed = 5
    fresh = PromptDataModule("arithmetic")
    fresh.load_state_dict(dm.state_dict())
    assert fresh.batches_consumed == 5
    with pytest.raises(ValueError, match="eval_splits \\['test'\\]"):
        PromptDataModule("arithmetic", eval_splits=["test"])


def _good_lines(n: int = 10) -> list[str]:
    return [json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) for i in range(n)]


def write_bad_file(folder, fault: str) -> str:
    """A data file with one fault: empty, non-UTF-8 bytes on line 3, a broken line 7, a line 7 that is a list, no
    answer column."""
    lines = _good_lines()
    path = folder / f"{fault}.jsonl"
    if fault == "empty":
        path.write_bytes(b"")
        return str(path)
    if fault == "not_utf8":
        raw = [line.encode() for line in lines]
        raw[2] = b'{"question": "caf\xe9 \xff", "answer": 1}'
        path.write_bytes(b"\n".join(raw) + b"\n")
        return str(path)
    if fault == "broken_line":
        lines[6] = '{"question": "What is 6 + 1?", "answer": '
    elif fault == "not_an_object":
        lines[6] = "[1, 2]"
    elif fault == "no_answer_column":
        lines = [json.dumps({"question": f"q{i}", "solution": i}) for i in range(10)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


BAD_FILES = {
    "empty": "the file is empty",
    "not_utf8": "line 3: not UTF-8 text (byte 0xe9 at column 18)",
    "broken_line": "line 7: not valid JSON",
    "not_an_object": "line 7: a JSON list, where each line should be an object",
}


@pytest.mark.parametrize("fault", BAD_FILES)
def test_a_malformed_file_is_one_error_naming_the_file_and_line(fault, tmp_path):
    path = write_bad_file(tmp_path, fault)
    with pytest.raises(InputError) as info:
        FileSource(path).rows("train")
    assert str(info.value).startswith(f"{path}: {BAD_FILES[fault]}")
    assert "\n" not in str(info.value)


def test_a_file_without_answers_loads_and_says_so_to_a_verifier_that_needs_them(tmp_path):
    """TRL-style data need no answer column (reward functions read their own columns); a verifier that scores
    against answers is told which file lacks them."""
    path = write_bad_file(tmp_path, "no_answer_column")
    source = FileSource(path)
    rows = source.rows("train")
    assert len(rows) == 10 and rows[3]["answer"] is None and rows[3]["columns"] == {"solution": 3}
    assert source.answer_fault().startswith(f"{path}: no column 'answer' for the answer (columns: ['question', 'solution'])")
    answered = tmp_path / "answered.jsonl"
    answered.write_text('{"question": "a", "answer": 1}\n')
    assert FileSource(str(answered)).answer_fault() is None


def test_a_broken_json_array_names_its_line(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[\n {"question": "a", "answer": 1},\n {"question": "b" "answer": 2}\n]\n')
    with pytest.raises(InputError, match=f"^{path}: line 3: not valid JSON"):
        FileSource(str(path)).rows("train")


def test_a_csv_row_with_extra_fields_names_its_line(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('question,answer\n"a?",1\n"b?",2,3,4\n')
    with pytest.raises(InputError, match=f"^{path}: could not be read as csv: .*Expected 2 fields in line 3, saw 4"):
        FileSource(str(path)).rows("train")
