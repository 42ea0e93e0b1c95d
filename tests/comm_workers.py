"""Rank functions for tests/test_comm_dist.py."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the message is the result under test
        return f"{exc}"


@record
def comm_worker(out_dir: str) -> None:
    env = RankEnv.from_env()
    init_process_group("gloo", 2.0, env)
    comm, r = Communicator(), env.rank
    res = {}
    rows = torch.tensor([[10 * r + i, -i] for i in range(2 - r)], dtype=torch.int64).reshape(-1, 2)
    res["all_gather"] = [t.tolist() for t in comm.all_gather_variable(rows)]
    got = comm.gather_variable(rows, dst=1)
    res["gather_to_1"] = None if got is None else [t.tolist() for t in got]
    res["float_rows"] = [t.tolist() for t in comm.all_gather_variable(torch.full((3 * (r + 1),), 0.5))]
    bad_dtype = rows.float() if r == 1 else rows
    res["dtype_mismatch"] = _catch(lambda: comm.all_gather_variable(bad_dtype))
    bad_shape = torch.zeros((1, 3 if r == 1 else 2), dtype=torch.int64)
    res["shape_mismatch"] = _catch(lambda: comm.all_gather_variable(bad_shape))
    res["meta"] = comm.broadcast_json({"run_id": "run-from-rank0", "seed": 1234, "t": time.time()}
                                      if r == 0 else None)
    comm.set_timeout(30)
    if r == 2:
        time.sleep(4)
    t = torch.ones(1)
    dist.all_reduce(t)
    res["slow_with_sync_timeout"] = int(t.item())
    comm.set_timeout(2)
    if r == 2:
        time.sleep(4)
    res["slow_without"] = _catch(lambda: dist.all_reduce(torch.ones(1)))
    Path(out_dir, f"rank{r}.json").write_text(json.dumps(res))
    destroy_process_group()
