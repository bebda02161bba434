import json

import pytest

from pipeline.errors import InputError
from pipeline.split import make_prompt, parse_mbpp_lines, split_conversations, split_rows
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


def chats(n, start=0):
    return [
        {
            "messages": [
                {"role": "user", "content": f"task {i}"},
                {"role": "user", "content": "more"},
            ]
        }
        for i in range(start, start + n)
    ]


def conversation_rows(n, start=0):
    from pipeline.data import make_row

    return [make_row(c["messages"]) for c in chats(n, start)]


def test_conversations_split_by_conversation_seeded_and_stable_as_data_grows():
    rows = conversation_rows(100)
    train, test = split_conversations(rows, 42, 60, 30)
    assert len(train) == 60 and len(test) == 30

    def ids(side):
        return [r["task_id"] for r in side]

    assert not set(ids(train)) & set(ids(test))
    assert (train, test) == split_conversations(list(reversed(rows)), 42, 60, 30)
    assert ids(split_conversations(rows, 7, 60, 30)[1]) != ids(test)
    # more data, same test size: no conversation that trained moves to the test side
    _, bigger_test = split_conversations(conversation_rows(300), 42, 200, 30)
    assert not set(ids(train)) & set(ids(bigger_test))
    tr, te = split_conversations(rows, 42, 0.8, 0.2)  # fractions of the rows
    assert (len(tr), len(te)) == (80, 20)
    with pytest.raises(InputError, match="exceeds the 100 unique rows.*fractions"):
        split_conversations(rows, 42, 90, 20)


def test_split_cli_on_a_chat_file(tmp_path):
    src = tmp_path / "chats.jsonl"
    lines = chats(30) + chats(2)  # two duplicates
    src.write_text("".join(json.dumps(c) + "\n" for c in lines))
    art = tmp_path / "art"
    sets = (
        "--set",
        f"data.source={src}",
        "--set",
        "data.train_size=20",
        "--set",
        "data.test_size=0.25",
    )
    r = run_cli("split", "--config", "configs/ci.yaml", "--artifacts", str(art), *sets)
    assert r.returncode == 0, r.stderr
    train = [json.loads(x) for x in (art / "data" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (art / "data" / "test.jsonl").read_text().splitlines()]
    manifest = json.loads((art / "data" / "manifest.json").read_text())
    assert (len(train), len(test)) == (20, 7)  # 0.25 of the 30 unique conversations
    assert all(r["messages"][0] == {"role": "user", "content": r["prompt"]} for r in train + test)
    assert manifest["format"] == "chat" and manifest["rows"] == 30
    assert manifest["duplicates_dropped"] == 2 and manifest["invalid_skipped"] == 0
    assert manifest["test_task_ids"] == [r["task_id"] for r in test]
    assert "format chat (inferred" in r.stderr


def test_split_cli_bad_chat_file_exit_2_names_the_line(tmp_path, cli):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(chats(1)[0]) + '\n{"messages": [{"role": "robot", "content": "x"}]}\n'
    )
    r = cli("split", "--artifacts", tmp_path / "art", "--set", f"data.source={bad}")
    assert r.returncode == 2 and f"{bad}:2" in r.log and "unknown role 'robot'" in r.log
    r = cli("split", "--artifacts", tmp_path / "art", "--set", f"data.source={tmp_path}/no.jsonl")
    assert r.returncode == 2 and "data file not found" in r.log


def test_mbpp_takes_whole_numbers_and_traffic_splits_captured_records(tmp_path, mbpp_path, cli):
    r = cli("split", "--artifacts", tmp_path, "--set", "data.test_size=0.1")
    assert r.returncode == 2 and "MBPP takes whole numbers" in r.log
    r = cli("split", "--artifacts", tmp_path, "--set", "data.format=traffic")
    assert r.returncode == 2 and "0 new trainable record(s)" in r.log
