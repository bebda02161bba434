import json

import pytest

from pipeline.errors import InputError
from pipeline.split import make_prompt, parse_mbpp_lines, split_rows
from tests.conftest import run_cli


def rows(n):
    return [
        {"task_id": i, "text": f"problem {i}", "test_list": [f"assert f({i})"], "code": ""}
        for i in range(1, n + 1)
    ]


def test_split_is_disjoint_sized_and_deterministic():
    data = rows(100)
    train, test = split_rows(data, 42, 60, 30)
    assert len(train) == 60 and len(test) == 30
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in test}
    again = split_rows(list(reversed(data)), 42, 60, 30)  # input order does not matter
    assert (train, test) == again
    other = split_rows(data, 7, 60, 30)
    assert [r["task_id"] for r in other[0]] != [r["task_id"] for r in train]


def test_sizes_exceeding_data_fail():
    with pytest.raises(InputError, match="exceeds"):
        split_rows(rows(10), 42, 8, 3)


def test_prompt_has_problem_and_one_test():
    p = make_prompt({"text": "Write f.", "test_list": ["assert f(1) == 2", "assert f(2) == 3"]})
    assert "Write f." in p and "assert f(1) == 2" in p and "assert f(2) == 3" not in p


@pytest.mark.parametrize(
    "line,needle",
    [
        ("{not json", "not valid JSON"),
        ('{"task_id": 5, "text": "x"}', "missing field 'test_list'"),
        ('{"task_id": "5", "text": "x", "test_list": ["a"]}', "'task_id' must be int"),
        ('{"task_id": 5, "text": "x", "test_list": []}', "non-empty"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_rows_name_the_line(line, needle):
    good = json.dumps(rows(1)[0])
    with pytest.raises(InputError) as e:
        parse_mbpp_lines([good, line], "f.jsonl")
    assert "f.jsonl:2" in str(e.value) and needle in str(e.value)


def test_split_cli_end_to_end(tmp_path, mbpp_path):
    art = tmp_path / "art"
    r = run_cli("split", "--config", "configs/default.yaml", "--artifacts", str(art))
    assert r.returncode == 0, r.stderr
    data = art / "data"
    train = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (data / "test.jsonl").read_text().splitlines()]
    manifest = json.loads((data / "manifest.json").read_text())
    assert len(train) == 500 and len(test) == 50
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in test}
    assert all(r["prompt"] and isinstance(r["task_id"], int) for r in train + test)
    assert (
        manifest["source_sha256"]
        == "ccf64ceae9c5403bf50a044cb6d505bfd2a2963ee58338ba268fd65beab92a9f"
    )
    assert manifest["train_task_ids"] == [r["task_id"] for r in train]
    assert (data / "config.yaml").is_file()
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    r = run_cli("split", "--config", "configs/default.yaml", "--artifacts", str(art))
    assert r.returncode == 0
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before  # byte-identical rerun


def test_split_cli_bad_input_exit_2_keeps_earlier_output(tmp_path, mbpp_path, cli, monkeypatch):
    art = tmp_path / "art"
    assert cli("split", "--artifacts", art).returncode == 0
    before = {p.name: p.read_bytes() for p in (art / "data").iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(mbpp_path.read_text().splitlines()[0] + "\n{oops\n")
    monkeypatch.setenv("PHOENIX_MBPP", str(bad))
    r = cli("split", "--artifacts", art)
    assert r.returncode == 2 and f"{bad}:2" in r.log
    monkeypatch.delenv("PHOENIX_MBPP")
    r = cli("split", "--artifacts", art, "--set", "data.train_size=2000")
    assert r.returncode == 2 and "exceeds" in r.log
    assert {p.name: p.read_bytes() for p in (art / "data").iterdir()} == before
    assert not [p for p in (art / "data").iterdir() if p.name.endswith(".tmp")]


def test_missing_source_is_a_clear_error(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("PHOENIX_MBPP", str(tmp_path / "nope.jsonl"))
    r = cli("split", "--artifacts", tmp_path)
    assert r.returncode == 2 and "MBPP file not found" in r.log
