"""The launchers with an output in an object store (moto on 127.0.0.1, tests/support/s3server.py):
a Slurm array, torchrun and a Kubernetes Indexed Job, each as two real rank processes started at
once with the environment that launcher gives (as tests/scale/test_scale_out.py and test_k8s.py
simulate them). Every shard is written exactly once into the store: one done marker and one
Parquet object each, every image once, no claim left. (Ray: tests/scale/test_ray.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.inputs import write_job
from support.s3server import bucket, s3, written  # noqa: F401 - the fixtures

from batchvlm.shapes.shards import write_shards

N_SHARDS, PER = 4, 1
LAUNCHERS = {
    "slurm": lambda r: {"SLURM_ARRAY_TASK_ID": str(r), "SLURM_ARRAY_TASK_COUNT": "2"},
    "torchrun": lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
    "k8s": lambda r: {"JOB_COMPLETION_INDEX": str(r), "BATCHVLM_WORLD": "2"},
}


def _written(log: str) -> int:
    return sum(int(line.split(" shard(s) written")[0].rsplit(" ", 1)[-1])
               for line in log.splitlines() if " shard(s) written" in line)


def test_two_ranks_of_each_launcher_write_every_shard_once_into_the_store(tmp_path, bucket):
    name, client = bucket
    write_shards(tmp_path / "data", N_SHARDS, PER, seed=9)
    procs = {}
    for launcher, env in LAUNCHERS.items():  # all six ranks at once, each launcher into its own prefix
        job = write_job(tmp_path / f"{launcher}.yaml", "data/shapes-*.tar", out=f"s3://{name}/{launcher}",
                        tasks=[{"caption": {}}], engine={"max_new_tokens": 4})
        procs[launcher] = [subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                            env=os.environ | env(r)) for r in range(2)]
    for launcher, ranks in procs.items():
        logs = [p.communicate(timeout=300)[1] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], (launcher, logs)
        assert sum(map(_written, logs)) == N_SHARDS, (launcher, logs)  # each shard committed by one rank
        stems = [f"shapes-{s:06d}" for s in range(N_SHARDS)]
        assert written(client, name, launcher) == {
            "top": [f"{s}.parquet" for s in stems], "markers": [f"__batchvlm__/{s}.stats.json" for s in stems],
            "claims": [], "images": [f"{s:06d}_{i:04d}" for s in range(N_SHARDS) for i in range(PER)]}, launcher
        record = json.loads(client.get_object(Bucket=name, Key=f"{launcher}/__batchvlm__/job.json")["Body"].read())
        assert record["world_size"] == 2, launcher
