"""Conversations in (prompts, chat, ShareGPT, HumanEval), one row shape out; bad input named."""

import json
import logging

import pytest

from benchmarks import mbpp_chat
from pipeline import data
from pipeline.errors import InputError
from pipeline.workspace import Workspace, atomic_write_jsonl

SYSTEM = {"role": "system", "content": "Be brief."}


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_each_shape_reads_to_the_same_rows(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    chat = write(
        tmp_path / "c.jsonl",
        [{"messages": [user("hi"), bot("yo"), user("more")], "system": "Be brief."}],
    )
    share = write(
        tmp_path / "s.jsonl",
        [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
                            {"from": "gpt", "value": "yo"}, {"from": "user", "value": "more"}]}],
    )  # fmt: skip
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "hi", "system": "Be brief."}])
    (c,), fmt_c = data.read_file(chat)
    (s,), fmt_s = data.read_file(share)
    (p,), fmt_p = data.read_file(prompts)
    assert (fmt_c, fmt_s, fmt_p) == ("chat", "sharegpt", "prompts")
    assert "format sharegpt (inferred" in caplog.text
    assert c == s  # ShareGPT's roles map onto OpenAI's: the same conversation, the same row
    assert c["messages"] == [SYSTEM, user("hi"), bot("yo"), user("more")]
    assert p["messages"] == [SYSTEM, user("hi")] and p["prompt"] == c["prompt"] == "hi"
    assert c["task_id"] == data.task_id_of(c["messages"]) != p["task_id"]
    assert isinstance(c["task_id"], int) and c["task_id"] < 16**12


def test_bench_messages_stop_at_the_first_unanswered_user_turn():
    u1, a1, u2, a2, u3 = user("1"), bot("a"), user("2"), bot("b"), user("3")
    assert data.bench_messages({"messages": [u1, u2, u3]}) == [u1]
    assert data.bench_messages({"messages": [u1, a1, u2, a2]}) == [u1, a1, u2]
    assert data.bench_messages({"messages": [SYSTEM, u1, a1, u2]}) == [SYSTEM, u1, a1, u2]
    assert data.bench_messages({"prompt": "p"}) == data.messages_of({"prompt": "p"}) == [user("p")]


def test_duplicates_are_dropped_and_counted(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    f = write(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "a"}])
    loaded = data.load_file(f)
    assert [r["prompt"] for r in loaded.rows] == ["a", "b"] and loaded.duplicates == 1
    assert "dropped 1 duplicate" in caplog.text


@pytest.mark.parametrize(
    "lines,fmt,needles",
    [
        (['{"prompt": "a"}', "{oops"], None, ["p.jsonl:2", "not valid JSON"]),
        (['{"messages": [{"role": "tool", "content": "x"}]}'], None, ["p.jsonl:1", "unknown role 'tool'"]),
        (['{"messages": [{"role": "assistant", "content": "x"}]}'], None, ["p.jsonl:1", "no user turn"]),
        (['{"messages": [{"role": "user", "content": " "}]}'], None, ["p.jsonl:1", "non-empty string"]),
        (['{"conversations": [{"from": "alien", "value": "x"}]}'], None, ["p.jsonl:1", "unknown 'from'"]),
        (['{"prompt": ""}'], None, ["p.jsonl:1", "'prompt' must be a non-empty string"]),
        (['{"prompt": "a"}', '{"prompt": "b"}'], "chat", ["expects lines with 'messages'", "2 prompts"]),
        (['{"prompt": "a"}', '{"messages": [{"role": "user", "content": "b"}]}'], None,
         ["a mix of shapes", "1 prompts ('prompt')", "1 chat ('messages')"]),
        (['{"question": "a"}', "[1]"], None, ["p.jsonl:2", "JSON object"]),
        (['{"question": "a"}'], None, ["nothing usable", "1 with none of those keys"]),
        (["", "  "], None, ["nothing usable", "no lines"]),
    ],
)  # fmt: skip
def test_bad_input_says_what_and_where(tmp_path, lines, fmt, needles):
    f = write(tmp_path / "p.jsonl", lines)
    with pytest.raises(InputError) as e:
        data.read_file(f, fmt)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_skip_invalid_skips_and_counts_once(tmp_path, caplog):
    bad_role = {"messages": [{"role": "tool", "content": "x"}, user("u")]}
    no_user = {"messages": [bot("a")]}
    good = {"messages": [user("u")]}
    f = write(tmp_path / "c.jsonl", [bad_role, good, no_user])
    with pytest.raises(InputError, match="c.jsonl:1: turn 1: unknown role"):
        data.read_file(f)
    loaded = data.load_file(f, "chat", skip_invalid=True)
    assert [r["messages"] for r in loaded.rows] == [[user("u")]] and loaded.invalid == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 2 invalid" in warnings[0].message
    with pytest.raises(InputError, match="nothing usable"):
        data.load_file(write(tmp_path / "n.jsonl", [no_user]), skip_invalid=True)


def test_humaneval_ships_in_the_package_and_sets_load_by_name(tmp_path):
    tasks = data.humaneval()
    assert len(tasks) == 164 and [t["task_id"] for t in tasks[:3]] == [0, 1, 2]
    first = tasks[0]
    assert first["messages"] == [user(first["prompt"])]
    assert first["prompt"].startswith("Complete this Python function.\n\n")
    assert "def has_close_elements" in first["prompt"]
    ws = Workspace(tmp_path)
    assert data.load_set("humaneval:100-164", ws) == tasks[100:]
    with pytest.raises(InputError, match="run split first"):
        data.load_set("heldout", ws)
    atomic_write_jsonl(ws.test_file, [{"task_id": 3, "prompt": "p"}])
    assert data.load_set("heldout", ws) == [{"task_id": 3, "prompt": "p"}]
    f = write(tmp_path / "p.jsonl", [{"prompt": "x"}])
    assert data.load_set(str(f), ws) == data.read_file(f)[0]
    with pytest.raises(InputError, match="humaneval:A-B"):
        data.load_set("humaneval:9-3", ws)


def test_mbpp_chat_builds_a_deterministic_multi_turn_chat_file(tmp_path, mbpp_path):
    out = tmp_path / "chats.jsonl"
    assert mbpp_chat.main(["--mbpp", str(mbpp_path), "--out", str(out), "--limit", "20"]) == 0
    rows, fmt = data.read_file(out)
    assert fmt == "chat" and len(rows) == 20
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "user", "user"]
        follow_ups = [m["content"] for m in row["messages"][2:]]
        assert len(set(follow_ups)) == 2 and set(follow_ups) <= set(mbpp_chat.FOLLOW_UPS)
        assert "Your code should pass this test:" in row["prompt"]
        assert data.bench_messages(row) == row["messages"][:2]  # the task, then the teacher answers
    again = tmp_path / "again.jsonl"
    mbpp_chat.main(["--mbpp", str(mbpp_path), "--out", str(again), "--limit", "20"])
    assert again.read_bytes() == out.read_bytes()
    picks = {tuple(m["content"] for m in r["messages"][2:]) for r in rows}
    assert len(picks) > 5  # the follow-ups vary across tasks


def test_hub_dataset_columns_map_onto_a_format(tmp_path):
    """The `datasets` loader itself, on a dataset folder laid out as on the Hub (no network)."""
    folder = tmp_path / "team-asks"
    folder.mkdir()
    records = [
        {"question": "q1", "id": 1},
        {"question": "q2", "id": 2},
        {"question": "q1", "id": 3},
    ]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = data.load_hub(str(folder), "test", {"prompt": "question"}, None)
    assert loaded.format == "prompts"
    assert [r["messages"] for r in loaded.rows] == [[user("q1")], [user("q2")]]
    assert loaded.duplicates == 1
    with pytest.raises(InputError, match="data.columns.messages: no column 'dialog'"):
        data.load_hub(str(folder), "test", {"messages": "dialog"}, None)
    with pytest.raises(
        InputError, match="could not load the Hub dataset .*split train.*local JSONL"
    ):
        data.load_hub(str(folder), "train", {}, "chat")  # no such split
