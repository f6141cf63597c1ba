"""Token counts per row and task, per shard, per run and per job (`status --json`), and the
Prometheus metrics file a run keeps (issue 40 item 15)."""

import json
import re
import time

import pyarrow.parquet as pq
from support.cli import cli, cli_app
from support.inputs import broken_shard, good_png, write_job, write_tar

from batchvlm.run.metrics import Meter, MetricsFile, rank_path

SAMPLE = re.compile(r'^(batchvlm_\w+)\{job_name="((?:[^"\\]|\\.)*)",rank="(\d+)"\} (\S+)$')


def parse_prom(text: str) -> dict[str, float]:
    """The text exposition format, as node_exporter's textfile collector reads it: HELP and TYPE
    before each sample, one sample a line, values Go's ParseFloat reads."""
    out, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge"), line
            typed.add(name)
        elif line.startswith("# HELP "):
            continue
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            assert m.group(1) in typed, f"{m.group(1)} has no TYPE line"
            out[m.group(1)] = float(m.group(4))
    return out


TASKS = [{"caption": {}}, {"detect": {"objects": ["circle", "square"]}},
         {"classify": {"question": "Which shape?", "choices": ["circle", "square"]}}]


def test_tokens_per_row_shard_run_and_job_and_the_metrics_file(tmp_path):
    broken_shard(tmp_path / "s-000.tar")  # error rows: no counts
    write_tar(tmp_path / "s-001.tar", [("a.png", good_png()), ("b.png", good_png(100, 80, (40, 40, 220)))])
    job = write_job(tmp_path / "job.yaml", "s-{000..001}.tar", tasks=TASKS, engine={"max_new_tokens": 4},
                    runtime={"metrics_file": "metrics/job.prom"})
    r = cli("run", job)
    rows = [row for p in sorted((tmp_path / "out").glob("*.parquet")) for row in pq.read_table(p).to_pylist()]
    ok = [row for row in rows if row["status"] == "ok"]
    assert ok and len(ok) < len(rows)
    for row in rows:
        cells = [row[f"{name}_tokens"] for name in ("caption", "detect", "classify")]
        if row["status"] == "error":
            assert cells == [None, None, None], row
            continue
        caption, detect, classify = cells
        assert min(caption["prompt"], detect["prompt"], classify["prompt"]) > 0, row
        # a caption cut by max_new_tokens generated exactly that many; one that ended itself wrote
        # its stop token too, within the limit
        assert caption["generated"] == 4 if row["caption_truncated"] else 1 <= caption["generated"] <= 4, row
        assert detect["generated"] > 0 and classify["generated"] == 0, row  # a scored choice generates nothing
        # two objects, two sequences on one image prefix: each reads it
        assert detect["prompt"] > caption["prompt"], row
    prompt = sum(row[f"{n}_tokens"]["prompt"] for row in ok for n in ("caption", "detect", "classify"))
    generated = sum(row[f"{n}_tokens"]["generated"] for row in ok for n in ("caption", "detect", "classify"))

    stats = [json.loads((tmp_path / "out" / "__batchvlm__" / f"s-00{i}.stats.json").read_text()) for i in (0, 1)]
    assert sum(s["tokens"]["prompt"] for s in stats) == prompt
    assert sum(s["tokens"]["generated"] for s in stats) == generated
    assert f"{prompt} prompt + {generated} generated tokens" in r.stderr, r.stderr
    report = json.loads(cli_app(tmp_path, "status", job, "--json", check=True).stdout)
    assert report["tokens"] == {"prompt": prompt, "generated": generated}, report

    metrics = parse_prom((tmp_path / "metrics" / "job.prom").read_text())
    assert metrics["batchvlm_rows_total"] == len(rows)
    assert metrics["batchvlm_errors_total"] == len(rows) - len(ok)
    assert metrics["batchvlm_prompt_tokens_total"] == prompt
    assert metrics["batchvlm_generated_tokens_total"] == generated
    assert metrics["batchvlm_shards_done"] == metrics["batchvlm_shards_total"] == 2
    assert metrics["batchvlm_finished"] == 1
    assert metrics["batchvlm_images_per_second"] > 0 and metrics["batchvlm_tokens_per_second"] > 0
    assert [p.name for p in (tmp_path / "metrics").iterdir()] == ["job.prom"]  # no temporary left

    # a run with nothing left to do says so too: every shard done, nothing labelled now
    cli("run", job)
    metrics = parse_prom((tmp_path / "metrics" / "job.prom").read_text())
    assert (metrics["batchvlm_rows_total"], metrics["batchvlm_shards_done"], metrics["batchvlm_finished"]) == (0, 2, 1)


def test_the_metrics_file_is_rewritten_while_the_run_lasts(tmp_path):
    meter = Meter(shards_total=3)
    path = tmp_path / "m.prom"
    metrics = MetricsFile(path, meter, 'a "job"\nname', rank=1, every_s=0.05)
    try:
        assert parse_prom(path.read_text())["batchvlm_rows_total"] == 0
        meter.add_row(False, 100, 7)
        meter.add_row(True, 0, 0)
        meter.shards_done = 1
        deadline = time.monotonic() + 10
        while parse_prom(path.read_text())["batchvlm_rows_total"] != 2:
            assert time.monotonic() < deadline, path.read_text()
            time.sleep(0.02)
    finally:
        metrics.close()
    text = path.read_text()
    assert 'job_name="a \\"job\\"\\nname",rank="1"' in text  # label values escaped
    values = parse_prom(text)
    assert (values["batchvlm_errors_total"], values["batchvlm_prompt_tokens_total"],
            values["batchvlm_generated_tokens_total"], values["batchvlm_shards_done"],
            values["batchvlm_shards_total"], values["batchvlm_finished"]) == (1, 100, 7, 1, 3, 1)
    assert abs(values["batchvlm_last_update_timestamp_seconds"] - time.time()) < 60


def test_each_rank_has_its_own_metrics_file():
    assert str(rank_path("/m/job.prom", 0, 1)) == "/m/job.prom"
    assert str(rank_path("/m/job.prom", 2, 4)) == "/m/job-rank2.prom"
    assert str(rank_path("/m/job-{rank}.prom", 2, 4)) == "/m/job-2.prom"


def test_a_metrics_file_url_is_refused_at_validate(tmp_path):
    write_tar(tmp_path / "s-000.tar", [("a.png", good_png())])
    job = write_job(tmp_path / "job.yaml", "s-000.tar", runtime={"metrics_file": "s3://bucket/job.prom"})
    r = cli_app(tmp_path, "validate", job)
    assert r.returncode == 2 and "runtime.metrics_file" in r.stdout and "URL" in r.stdout, r.stdout


def test_a_metrics_file_that_cannot_be_written_is_said_once_and_labelling_goes_on(tmp_path, capsys):
    (tmp_path / "blocker").write_text("a file where the folder should be")
    metrics = MetricsFile(tmp_path / "blocker" / "m.prom", Meter(shards_total=1), "j", rank=0, every_s=0.01)
    time.sleep(0.1)
    metrics.close()
    err = capsys.readouterr().err
    assert err.count("runtime.metrics_file: cannot write") == 1 and "labelling goes on" in err, err
