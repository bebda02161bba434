from pathlib import Path

import pytest

from pipeline.config import Config, load_config
from pipeline.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"default.yaml", "qwen3.yaml", "ci.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.data.seed == 42 and cfg.data.train_size == 500 and cfg.data.test_size == 50


def test_qwen3_is_the_reference_setup():
    cfg = load_config(Path(CONFIGS[0]).parent / "qwen3.yaml")
    assert cfg.models.target == "Qwen/Qwen3-1.7B" and cfg.models.draft == "Qwen/Qwen3-0.6B"
    assert cfg.teacher.max_tokens == 256 and cfg.bench.max_new_tokens == 128
    assert cfg.teacher.enable_thinking is False
    # Production: no silent loss of traces. The demo and CI configs keep Sentry optional.
    assert cfg.observability.required is True
    for name in ("default.yaml", "ci.yaml"):
        assert load_config(Path(CONFIGS[0]).parent / name).observability.required is False


def test_unknown_key_names_key_and_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  seeed: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "data.seeed" in str(e.value) and str(f) in str(e.value)


def test_wrong_type_names_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  train_size: lots\n")
    with pytest.raises(ConfigError, match="data.train_size"):
        load_config(f)


def test_overrides_are_typed_and_validated(tmp_path):
    cfg = load_config(
        None, ["data.train_size=10", "distill.limit=null", "teacher.url=http://x:1/v1"]
    )
    assert (
        cfg.data.train_size == 10
        and cfg.distill.limit is None
        and cfg.teacher.url == "http://x:1/v1"
    )
    with pytest.raises(ConfigError, match="nope"):
        load_config(None, ["nope.x=1"])
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["data.seed"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_an_eagle3_head_learns_kd_from_the_target_only():
    """The head's kd reads the target's top-N cached with its states: kd is accepted, but not
    from the teacher endpoint, not on-policy and not with another divergence; each refusal
    names the setting to change."""
    base = ["models.draft=eagle3", "train.method=full"]
    cfg = load_config(None, [*base, "train.objective=kd"])
    assert cfg.train.objective == "kd" and cfg.kd_source() == "target"
    remote = ["teacher.url=http://127.0.0.1:9/v1", "train.top_logprobs=5"]  # auto: still target
    cfg = load_config(None, [*base, "train.objective=kd", *remote])
    assert cfg.kd_source() == "target" and cfg.requested_logprobs() is None
    for extra, named in [
        (["train.objective=on_policy"], "train.objective=on_policy"),
        (["train.objective=kd", "train.kd_source=teacher", "train.top_logprobs=5"],
         "train.kd_source=target"),
        (["train.objective=kd", "train.divergence=tv"], "train.divergence=tv"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=named):
            load_config(None, [*base, *extra])


def test_bandit_arms_validated():
    with pytest.raises(ConfigError, match="bandit.arms"):
        load_config(None, ["bandit.arms=[2,2]"])


def test_arms_are_strategies_and_lengths():
    cfg = load_config(None, ["bandit.arms=[0, 4, 'fixed:2', 'ngram:3']", "bench.fixed_arms=[4]"])
    assert cfg.bandit.arms == ["0", "draft:4", "draft:2", "ngram:3"]
    assert cfg.bench.fixed_arms == ["draft:4"]
    for bad, why in (
        ("[0, 'lookahead:4']", "unknown draft strategy"),
        ("[0, 'ngram:x']", "K must be an integer"),
        ("[0, 'ngram:99']", "K must be in 1..16"),
        ("[0, 'draft:4', 4]", "distinct"),
    ):
        with pytest.raises(ConfigError, match="bandit.arms") as err:
            load_config(None, [f"bandit.arms={bad}"])
        assert why in str(err.value) and "ngram:K" in str(err.value)  # names the valid forms


def test_bad_arm_in_config_exits_2(tmp_path, cli):
    r = cli(
        "split",
        "--config",
        "configs/ci.yaml",
        "--artifacts",
        tmp_path,
        "--set",
        "bandit.arms=[0,'warp:2']",
    )
    assert r.returncode == 2 and "unknown draft strategy" in r.log and "ngram:K" in r.log
