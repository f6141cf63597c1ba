"""Who am I in a multi-process run, and which shards are mine.

Global rank = ((array task * processes per task) + process) * local workers + local worker:

    Slurm array     SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT (webdataset's node splitter
                    does not read these, so shards are partitioned here)
    or Kubernetes   JOB_COMPLETION_INDEX of an Indexed Job / BATCHVLM_WORLD (the Job's
                    completions: Kubernetes does not export the count); a pod plays the part
                    of an array task, and a pod recreated with the same index takes the same shards
    processes       torchrun / accelerate (RANK, WORLD_SIZE, LOCAL_RANK) or Slurm tasks
                    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID)
    local workers   processes `batchvlm run` starts itself, one per GPU (BATCHVLM_LOCAL_*)

Every rank lists the same sorted shards and takes every world-th one from its rank on, so the
partition is deterministic, disjoint and complete, whichever ranks run when.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .data.sources import ShardRef

LOCAL_RANK_ENV, LOCAL_WORLD_ENV = "BATCHVLM_LOCAL_RANK", "BATCHVLM_LOCAL_WORLD"
K8S_INDEX_ENV, K8S_WORLD_ENV = "JOB_COMPLETION_INDEX", "BATCHVLM_WORLD"


@dataclass(frozen=True)
class Rank:
    rank: int  # global rank
    world: int  # number of ranks
    local: int  # index on this node (selects the GPU)
    # Started by a launcher (torchrun, accelerate, srun with several tasks, or our own spawner):
    # this process is one worker and must not spawn more. A Slurm array task alone is not: it
    # starts the workers of its node.
    launched: bool = False


def _int(env: dict[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number") from None


def _array_task(env: dict[str, str]) -> tuple[int, int]:
    """(index, count) of this node's task: a Slurm array task or a Kubernetes Indexed Job pod."""
    k8s = [name for name in (K8S_INDEX_ENV, K8S_WORLD_ENV) if env.get(name, "") != ""]
    if not k8s:
        array_id = _int(env, "SLURM_ARRAY_TASK_ID", 0)
        if "SLURM_ARRAY_TASK_MIN" in env and "SLURM_ARRAY_TASK_COUNT" in env:
            array_id -= _int(env, "SLURM_ARRAY_TASK_MIN", 0)  # arrays may start at any index
        return array_id, _int(env, "SLURM_ARRAY_TASK_COUNT", 1)
    if len(k8s) == 1:
        raise ValueError(f"{K8S_INDEX_ENV} and {K8S_WORLD_ENV} go together (a Kubernetes Indexed Job: the pod's "
                         f"index and the Job's spec.completions); only {k8s[0]} is set")
    if "SLURM_ARRAY_TASK_ID" in env:
        raise ValueError(f"both a Slurm array task and a Kubernetes Indexed Job ({K8S_INDEX_ENV}) are set: "
                         "one launcher at a time")
    index, count = _int(env, K8S_INDEX_ENV, 0), _int(env, K8S_WORLD_ENV, 1)
    if not 0 <= index < count:
        raise ValueError(f"{K8S_INDEX_ENV}={index} is not below {K8S_WORLD_ENV}={count}: set {K8S_WORLD_ENV} to the "
                         "Job's spec.completions")
    return index, count


def resolve_rank(env: dict[str, str] | None = None) -> Rank:
    env = dict(os.environ if env is None else env)
    array_id, array_n = _array_task(env)
    if "WORLD_SIZE" in env:  # torchrun, accelerate launch
        proc, procs, local = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1), _int(env, "LOCAL_RANK", 0)
    elif "SLURM_NTASKS" in env:
        proc, procs, local = _int(env, "SLURM_PROCID", 0), _int(env, "SLURM_NTASKS", 1), _int(env, "SLURM_LOCALID", 0)
    else:
        proc, procs, local = 0, 1, 0
    sub, subs = _int(env, LOCAL_RANK_ENV, 0), _int(env, LOCAL_WORLD_ENV, 1)
    rank = ((array_id * procs) + proc) * subs + sub
    world = array_n * procs * subs
    if not 0 <= rank < world:
        raise ValueError(f"inconsistent rank environment: rank {rank} of {world}")
    return Rank(rank, world, local * subs + sub, launched=procs > 1 or LOCAL_RANK_ENV in env)


def my_shards(shards: list[ShardRef], rank: Rank) -> list[ShardRef]:
    """Round-robin over the sorted shard list: deterministic, disjoint, and the union is all."""
    return shards[rank.rank :: rank.world]
