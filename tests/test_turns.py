"""Conversations: the teacher answers turn by turn with its own answers in the history, each
(conversation, turn) resumable; training rows weigh only what the target said."""

import json

import pytest
import yaml

from pipeline.distillation import build_examples
from pipeline.teacher import answered_turns, history, load_all_answers
from tests.conftest import TINY_TARGET
from tests.fake_openai import FakeOpenAI, canned_answer

SYSTEM = {"role": "system", "content": "You are a helpful coding assistant."}
CHAT = [
    SYSTEM,
    {"role": "user", "content": "Write a function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b): return a + b"},
    {"role": "user", "content": "Add type hints and a docstring."},
    {"role": "assistant", "content": "(an answer from the log)"},
    {"role": "user", "content": "Now write three tests."},
]


def test_history_replaces_the_logs_answers_with_the_teachers_own():
    assert answered_turns(CHAT, "all") == [0, 1, 2] and answered_turns(CHAT, "last") == [2]
    assert history(CHAT, 0, [], "all") == CHAT[:2]
    got = history(CHAT, 2, ["A0", "A1"], "all")
    assert [m["role"] for m in got] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in got if m["role"] == "assistant"] == ["A0", "A1"]
    assert history(CHAT, 2, [], "last") == CHAT  # earlier assistant turns kept as given
    # No assistant turns in the file at all: the teacher's answers still go between the users.
    users = [m for m in CHAT if m["role"] == "user"]
    assert history(users, 1, ["A0"], "all") == [users[0], {"role": "assistant", "content": "A0"},
                                                 users[1]]  # fmt: skip


def test_a_multi_turn_row_weighs_assistant_tokens_one_and_the_rest_zero(tiny_models):
    """One row for the whole conversation (the template renders each turn's history as the
    row so far), its mask 1 exactly on each answer and its end-of-turn token."""
    from pipeline import models

    tok = tiny_models[0]
    answers = ["def add(a: int, b: int) -> int: ...", "assert add(1, 2) == 3"]
    rows = [
        {"task_id": 7, "turn": t, "messages": history(CHAT[:4], t, answers, "all"),
         "completion": answers[t], "finish_reason": "stop"}
        for t in range(2)
    ]  # fmt: skip
    (row,), _ = build_examples(rows, tok, {}, 4096)
    ids, mask = row["input_ids"], row["completion_mask"]
    full = history(CHAT[:4] + [{"role": "user", "content": "x"}], 2, answers, "all")[:-1]
    rendered = tok.apply_chat_template(full, tokenize=False)
    assert tok.decode(ids) == rendered.rstrip("\n")  # the template's own output, token for token
    eos = tok.eos_token_id
    spans, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    spans.append(cur) if cur else None
    assert [tok.decode(s) for s in spans] == [a + tok.decode([eos]) for a in answers]
    unweighted = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    for m in CHAT[:4]:
        if m["role"] != "assistant":
            assert m["content"] in unweighted  # system and user tokens weigh 0
    assert sum(mask) == sum(len(models.text_prompt_ids(tok, a)) + 1 for a in answers)


def test_a_template_that_renders_history_otherwise_gets_a_row_per_turn(tiny_models):
    """Where an earlier turn's tokens differ in the next turn's history (Qwen3 drops an earlier
    turn's thinking), each turn is its own row: prompt as the server renders it, then the answer."""
    tok = tiny_models[0]
    rows = [
        {"task_id": 1, "turn": 0, "messages": CHAT[:2], "completion": "one", "finish_reason": "stop",
         "completion_token_ids": tok("one two", add_special_tokens=False)["input_ids"]},
        {"task_id": 1, "turn": 1, "messages": history(CHAT[:4], 1, ["one"], "all"),
         "completion": "two", "finish_reason": "stop"},
    ]  # fmt: skip
    got, _ = build_examples(rows, tok, {}, 4096)
    assert len(got) == 2 and all(r["completion_mask"][0] == 0 for r in got)


def test_reasoning_is_trained_on_only_when_asked(tiny_models):
    tok = tiny_models[0]
    row = {"task_id": 1, "prompt": "p", "completion": "answer", "reasoning": "because",
           "completion_token_ids": [1, 2, 3], "finish_reason": "length"}  # fmt: skip
    for include, expect in ((False, "answer"), (True, "<think>\nbecause\n</think>\n\nanswer")):
        (r,), _ = build_examples([row], tok, {}, 512, include_reasoning=include)
        said = [i for i, m in zip(r["input_ids"], r["completion_mask"], strict=True) if m]
        assert tok.decode(said) == expect


def write_chats(tmp_path, url, chats, **distill):
    art = tmp_path / "art"
    (art / "data").mkdir(parents=True, exist_ok=True)
    rows = [{"task_id": 100 + i, "messages": m, "prompt": m[1]["content"]}
            for i, m in enumerate(chats)]  # fmt: skip
    (art / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "models": {"target": TINY_TARGET},
        "teacher": {"url": url, "model": "fake", "max_tokens": 16, "ready_timeout_s": 20},
        "distill": distill,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), art


def test_distill_answers_each_turn_with_its_own_answers_and_resumes_per_turn(tmp_path, cli):
    chats = [CHAT, CHAT[:2] + [{"role": "user", "content": "Shorter, please."}]]
    with FakeOpenAI(reasoning=True) as fake:
        cfg, art = write_chats(tmp_path, fake.url, chats)
        assert cli("distill", "--config", cfg, "--artifacts", str(art)).returncode == 0
        bodies = list(fake.chat_bodies)
        answers = art / "teacher" / "answers.jsonl"
        rows = load_all_answers(answers)
        assert sorted(rows) == [(100, t, 0) for t in range(3)] + [(101, t, 0) for t in range(2)]
        for (_, t, _), row in rows.items():
            sent = row["messages"]
            said = [m["content"] for m in sent if m["role"] == "assistant"]
            assert len(said) == t and "(an answer from the log)" not in said
            earlier = [rows[(row["task_id"], s, 0)]["completion"] for s in range(t)]
            assert said == earlier  # on-policy: its own answers, not the log's
            assert row["completion"] == canned_answer(sent[-1]["content"])
            assert row["reasoning"].startswith("Think: ") and "Think" not in row["completion"]
        assert len(bodies) == 5 and all(b["messages"][0] == SYSTEM for b in bodies)
        # Lose the last turn of the first conversation: a rerun asks for exactly that turn.
        kept = [x for x in answers.read_text().splitlines() if '"turn": 2' not in x]
        answers.write_text("".join(x + "\n" for x in kept))
        r = cli("distill", "--config", cfg, "--artifacts", str(art))
        assert r.returncode == 0 and "1 answers to go" in r.log
        assert (
            len(fake.chat_bodies) == 6
            and fake.chat_bodies[-1]["messages"] == rows[(100, 2, 0)]["messages"]
        )
    summary = json.loads((art / "teacher" / "summary.json").read_text())
    assert summary["answers"] == 5 and summary["conversations"] == 2


def test_turns_last_answers_the_final_turn_on_the_given_history(tmp_path, cli):
    with FakeOpenAI() as fake:
        cfg, art = write_chats(tmp_path, fake.url, [CHAT], turns="last")
        assert cli("distill", "--config", cfg, "--artifacts", str(art)).returncode == 0
        assert [b["messages"] for b in fake.chat_bodies] == [CHAT]


@pytest.mark.parametrize("extra,asked", [(2, 1), (10_000, 3)])
def test_turns_past_the_context_are_dropped_with_one_warning(
    tmp_path, cli, tiny_models, extra, asked
):
    """data.max_context bounds history + teacher.max_tokens: later turns of a long
    conversation are dropped and counted once; a rerun asks nothing more."""
    from pipeline import models

    room = len(models.chat_prompt_ids(tiny_models[0], CHAT[:2])) + 16 + extra
    with FakeOpenAI() as fake:
        cfg, art = write_chats(tmp_path, fake.url, [CHAT])
        opt = ("--set", f"data.max_context={room}")
        r = cli("distill", "--config", cfg, "--artifacts", str(art), *opt)
        assert r.returncode == 0, r.log
        assert len(fake.chat_bodies) == asked
        warned = [x for x in r.log.splitlines() if "dropped" in x and "WARNING" in x]
        assert len(warned) == (asked < 3)
        if asked < 3:
            assert "2 turn(s) of 1 conversation(s)" in warned[0]
            again = cli("distill", "--config", cfg, "--artifacts", str(art), *opt)
            assert again.returncode == 0 and len(fake.chat_bodies) == asked
