"""report_to: TensorBoard event files and an MLflow store (SQLite) written by real toy runs, read back with the
trackers' own readers, hold the metrics of metrics.jsonl under the same names and steps."""

import json

import pytest

from paravt_train.infra.tracking import MetricsLog, flat_metrics, parse_report_to

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")


def jsonl(out) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def tensorboard_scalars(out) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(out / "tensorboard"))
    mux.Reload()
    scalars: dict[str, list[tuple[int, float]]] = {}
    for run, tags in mux.Runs().items():  # a resumed run adds an event file: one TensorBoard "run" per file
        for tag in tags["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in mux.Scalars(run, tag))
    return {tag: sorted(v) for tag, v in scalars.items()}


def mlflow_runs(out):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name("paravt")
    return client, client.search_runs([exp.experiment_id])


def assert_trackers_hold(out, recs: list[dict], param: tuple[str, str]) -> None:
    expected: dict[str, list[tuple[int, float]]] = {}
    for rec in recs:
        for name, value in flat_metrics(rec).items():
            expected.setdefault(name, []).append((rec["step"], value))
    assert expected, "metrics.jsonl is empty"
    tb = tensorboard_scalars(out)
    assert set(tb) == set(expected)
    for name, points in expected.items():
        assert [s for s, _ in tb[name]] == [s for s, _ in points], name
        assert [v for _, v in tb[name]] == pytest.approx([v for _, v in points], rel=1e-5, abs=1e-6), name
    client, runs = mlflow_runs(out)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert set(run.data.metrics) == set(expected)
    assert run.data.params[param[0]] == param[1]  # the run's config, once
    for name, points in expected.items():
        hist: dict[int, float] = {}
        for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.timestamp):
            hist[m.step] = m.value  # a step redone after a resume: the later value
        assert sorted(hist) == [s for s, _ in points], name
        assert [hist[s] for s, _ in points] == pytest.approx([v for _, v in points], rel=1e-9, abs=1e-12), name


def test_report_to_is_checked():
    assert parse_report_to(None) == [] and parse_report_to("none") == []
    assert parse_report_to("TensorBoard, mlflow,tensorboard") == ["tensorboard", "mlflow"]
    assert parse_report_to("all") == ["tensorboard", "mlflow", "wandb", "trackio"]
    with pytest.raises(ValueError, match="unknown tracker"):
        parse_report_to(["tensorbored"])
    # every numeric value, nested ones flattened; strings, lists and non-finite numbers are not metrics
    assert flat_metrics({"step": 3, "time": 1.0, "loss": 0.5, "acc": {"mcq": 1, "tvg": float("nan")},
                         "prompts": ["a"], "note": "x", "ok": True}) == {"loss": 0.5, "acc/mcq": 1.0, "ok": 1.0}


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLog(tmp_path, ["tensorboard", "mlflow"], {"lr": 1}, rank=1)
    log.log({"step": 1, "loss": 1.0})
    log.close()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def sft_rows(tmp_path_factory):
    from paravt_agent.prompts import TOOL_SYSTEM_PROMPT, question_text
    from paravt_train.data import write_parquet
    from paravt_train.toy.render import write_segments

    d = tmp_path_factory.mktemp("track")
    rows = []
    for v, (name, rgb) in enumerate({"red": (230, 25, 75), "blue": (0, 130, 200)}.items()):
        write_segments(d / f"v{v}.mp4", [(rgb, 2.0)], fps=2, width=32, height=32)
        rows.append({"id": f"p{v}", "messages": [
            {"role": "system", "content": TOOL_SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "video", "video": f"v{v}.mp4", "n_frames": 2},
                                         {"type": "text", "text": question_text("Which colour?")}]},
            {"role": "assistant", "content": f"<think>\nThe frames are {name}.</think>\n<answer>{name}</answer>"}]})
    write_parquet(rows, d / "train.parquet")
    return d


def test_sft_reports_to_tensorboard_and_mlflow_and_a_resume_continues_the_same_run(tiny_model, sft_rows, tmp_path):
    from paravt_train.sft import train
    from paravt_train.sft.config import SFTConfig

    out = tmp_path / "sft"

    def cfg(steps):
        return SFTConfig(model=tiny_model, data=str(sft_rows / "train.parquet"), video_root=str(sft_rows),
                         output_dir=str(out), lr=3e-3, batch_size=2, micro_batch_size=2, max_steps=steps,
                         save_every=2, warmup_ratio=0.0, frames={"max_pixels": 1024}, save_final=False,
                         report_to="tensorboard,mlflow")

    train(cfg(3), progress=False)  # checkpoint-2, then step 3 (lost in a crash: no checkpoint holds it)
    first = mlflow_runs(out)[1][0].info.run_id
    train(cfg(5), progress=False)  # resumes at 2: redoes 3, the trackers' runs go on
    recs = jsonl(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert_trackers_hold(out, recs, ("lr", "0.003"))
    assert mlflow_runs(out)[1][0].info.run_id == first


def test_grpo_reports_every_step_metric_with_nested_names(toy_policy_dir, toy_rl, tmp_path):
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer

    out = tmp_path / "grpo"
    cfg = GRPOConfig(model=toy_policy_dir, data=toy_rl["data"], video_root=toy_rl["video_root"], output_dir=str(out),
                     steps=2, prompts_per_step=2, group_size=2, max_new_tokens=96, subagent_max_new_tokens=40,
                     save_every=2, concurrency=2, report_to=["tensorboard", "mlflow"])
    GRPOTrainer(cfg, progress=False).run()
    recs = jsonl(out)
    assert [r["step"] for r in recs] == [1, 2]
    assert any("/" in name for name in flat_metrics(recs[0]))  # e.g. reward/acc, closure/think
    assert_trackers_hold(out, recs, ("method", "para-grpo"))


def test_tensorboard_after_a_fresh_restart_a_resume_a_reopen_and_a_torn_line(tmp_path):
    log = MetricsLog(tmp_path, ["tensorboard"], {"lr": 1}).start(0)
    for s in (1, 2, 3):
        log.log({"step": s, "loss": 100.0 + s})
    log.close()
    log = MetricsLog(tmp_path, ["tensorboard"], {"lr": 1}).start(0)  # a fresh start: the old attempt's points go
    for s in (1, 2, 3):
        log.log({"step": s, "loss": float(s)})
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')  # a line a kill -9 cut short
    log = MetricsLog(tmp_path, ["tensorboard"], {"lr": 1}).start(2)  # resumed at 2: step 3 is redone
    log.log({"step": 3, "loss": 30.0})
    log.close()
    log.log({"step": 4, "loss": 40.0})  # logging after close(): the same run goes on, nothing dropped
    log.close()
    assert tensorboard_scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [r["step"] for r in jsonl(tmp_path)] == [1, 2, 3, 4]
