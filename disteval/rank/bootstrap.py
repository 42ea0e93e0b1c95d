"""Rank bootstrap: this rank's records and log, the process group and its Communicator, an agreed run
directory under external launchers, and the per-rank compute settings (threads, determinism)."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from disteval import precision as prec
from disteval.comm import Communicator, RankEnv, init_process_group, resolve_backend, resolve_device
from disteval.config import JobConfig, job_config
from disteval.errors import DiskFullError, DistevalError, RankDiedError
from disteval.comm.board import StoreBoard, detect_shared_filesystem
from disteval.common import launch_env, netif, startup
from disteval.common.liveness import beat_lag
from disteval.job.records import (StatusWriter, config_digest, error_record, is_network_error, pid_alive, rank_dir,
                              read_status, recorded_progress, relay_records, zombie_exit)

log = logging.getLogger("disteval.rank")  # to RUN_DIR/ranks/rank{r}/log.txt only (not the console)
log.propagate = False


@dataclass
class RankContext:
    """Everything a rank's run needs about where and how it runs; ``cfg``: the job's typed ``JobConfig``."""

    cfg: JobConfig
    run_dir: str
    rank: int
    world_size: int
    env: RankEnv | None
    status: StatusWriter
    device: torch.device | None = None
    backend: str | None = None
    comm: Communicator | None = None
    compute: dict | None = None
    net: dict | None = None  # host, node, node_rank, interface, address, ifname source (results.json per_rank)
    board: StoreBoard | None = None  # status records through the rendezvous store (launched ranks)
    filesystem: str = "local"  # "shared": every rank sees every record in the run directory; else "node-local"
    cpu_kernels: dict | None = None  # dist.heterogeneous=pin: every rank's native CPU kernel set and the pinned one

    def read_peer(self, rank: int) -> dict | None:
        """Rank ``rank``'s status record: its status.json on a shared run directory (or a single process), else
        what it published in the rendezvous store (``disteval.comm.board``)."""
        if self.board is None or self.filesystem == "shared":
            return read_status(self.run_dir, rank)
        return self.board.read(rank)

    def share_failure(self) -> None:
        """After this rank recorded its failure, on a run whose nodes do not share the run directory: put the
        record in the rendezvous store now (the sending thread may not get to it before the process ends),
        waiting at most the store's operation timeout (a cut-off store never answers). When the error is a
        consequence of a peer's (a network error: a rank that raised or was killed ends the others' collectives
        within milliseconds, before its last records reach the store) or blames such a rank: first
        ``_report_dead_neighbours``, then copy the other nodes' records into this node's run directory until one
        of them records a failure of its own or ``beat_lag`` seconds pass (the launcher usually stops this rank
        sooner), so that this node's driver and doctor name the rank that failed first. Never raises."""
        if self.board is None or self.filesystem == "shared" or not self.net:
            return
        record = dict(self.status.record)
        if not (self._send_now(record) and _quietly(self._a_consequence, record.get("error"))):
            return  # no store to tell or read, or this rank's error is its own
        log.info("a consequence of another rank's failure: reporting this node's dead ranks, relaying the others")
        _quietly(self._report_dead_neighbours)
        _quietly(self._relay_until_the_cause)

    def _a_consequence(self, error: dict | None) -> bool:
        """A network error, or a ``PeerFailedError`` blaming a rank whose own record holds a network error."""
        if is_network_error(error):
            return True
        blamed = (error or {}).get("blames")
        return blamed is not None and is_network_error((self.board.read(int(blamed)) or {}).get("error"))

    def _send_now(self, record: dict, rank: int | None = None) -> bool:
        """``record`` in the store, waiting at most its operation timeout; False when the store did not answer."""
        sender = threading.Thread(target=_quietly, args=(self.board.publish_now, record, rank), daemon=True)
        sender.start()
        sender.join(self.board.op_timeout_s)
        return not sender.is_alive()

    def _report_dead_neighbours(self) -> None:
        """For each rank of this node whose record here is unfinished and whose process is gone (this node's
        pids: its record's ``node``), put in the store its record marked failed with a ``RankDiedError`` saying
        so: it could not, and the other nodes see only what it published before it died."""
        node = self.net.get("node")
        for r in range(self.world_size):
            s = read_status(self.run_dir, r) if r != self.rank else None
            if not s or s.get("relayed") or s.get("node") != node or s.get("phase") in ("done", "failed") \
                    or not s.get("pid") or pid_alive(s["pid"]):
                continue
            how = zombie_exit(int(s["pid"])) or "is gone"
            error = error_record(RankDiedError(
                f"rank {r} stopped without recording an error: its process (pid {s['pid']}) {how}, in "
                f"{recorded_progress(s)}; seen by rank {self.rank} on the same node ({s.get('host') or node})"))
            self._send_now(dict(s, phase="failed", error=error, t_update=time.time(), reported_by=self.rank), r)
            log.info("reported rank %d as dead (pid %s %s) in the rendezvous store", r, s["pid"], how)

    def _relay_until_the_cause(self) -> None:
        node = self.net.get("node")
        self.board.watched = list(range(self.world_size))
        deadline = time.monotonic() + beat_lag(None)
        while True:
            time.sleep(self.board.poll_s)  # the reading thread's next pass
            records = [self.board.read(r) for r in range(self.world_size)]
            relay_records(self.run_dir, records, node)
            if time.monotonic() >= deadline or any(
                    s and s.get("node") != node and s.get("phase") == "failed" and not is_network_error(s.get("error"))
                    for s in records):
                return


def _quietly(fn, *args):
    """``fn(*args)``, or None when it raises (evidence only: the rank's own file record stands)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        return None


def setup_logging(run_dir: str, rank: int) -> None:
    """Send the ``disteval.rank`` logger to RUN_DIR/ranks/rank{rank}/log.txt (replacing earlier handlers)."""
    path = rank_dir(run_dir, rank) / "log.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    for old in list(log.handlers):
        log.removeHandler(old)
        old.close()
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def open_records(cfg: JobConfig, run_dir: str, env: RankEnv | None) -> RankContext:
    """This rank's status.json and log, and its context holding the typed job config (a job container, dict or
    DictConfig, is validated into a ``JobConfig``: ConfigError naming the key). Raises DistevalError naming the
    folder when it cannot write the records."""
    cfg = job_config(cfg)
    rank, world_size = (env.rank, env.world_size) if env else (0, 1)
    try:
        status = StatusWriter(run_dir, rank, world_size, interval_s=float(cfg.eval.status_interval_s))
        setup_logging(run_dir, rank)
    except DiskFullError:
        raise  # names ENOSPC, the file and the bytes it needed
    except OSError as exc:
        raise DistevalError(f"rank {rank} cannot write its records under {run_dir}/ranks: {exc}") from exc
    return RankContext(cfg, run_dir, rank, world_size, env, status)


def connect(ctx: RankContext, agree_run_dir: bool = False) -> None:
    """Init the process group (backend and timeout of ``communication.*``), build the Communicator (each
    collective noted in status.json), and with ``agree_run_dir`` (external launchers, where each rank
    composed its own config) move this rank's records next to rank 0's. Raises DistevalError when the ranks
    were started with different seeds."""
    cfg, env = ctx.cfg, ctx.env
    ctx.device = resolve_device(cfg.dist.device, env.local_rank if env else 0)
    ctx.backend = resolve_backend(cfg.communication.backend, ctx.device)
    ctx.status.update(force=True, config_digest=config_digest(cfg), rendezvous={
        "backend": ctx.backend, "master_addr": os.environ.get("MASTER_ADDR") if env else None,
        "master_port": int(os.environ["MASTER_PORT"]) if env and os.environ.get("MASTER_PORT") else None,
        "timeout_s": float(cfg.communication.timeout_s)})
    ctx.net = _network(env)
    init_process_group(ctx.backend, cfg.communication.timeout_s, env)
    ctx.status.update(force=True, joined=time.time())
    cc = cfg.communication
    ctx.comm = Communicator("cpu" if ctx.backend == "gloo" else ctx.device,
                            on_collective=lambda op, n, info: _collective_started(ctx, op, n, info),
                            async_threshold_bytes=cc.async_threshold_bytes, chunk_bytes=cc.chunk_bytes,
                            max_in_flight=cc.max_in_flight)
    ctx.comm.timeout_s, ctx.comm.progress_bytes = float(cc.timeout_s), cc.progress_bytes
    ctx.comm.timeout_key = "communication.timeout_s"
    ctx.comm.on_complete = lambda record: _collective_finished(ctx, record)
    ctx.comm.on_progress = lambda op, done, total: _collective_progress(ctx, done)
    if agree_run_dir and env is not None:
        _agree_run_dir(ctx)
    if env is not None:
        ctx.board = StoreBoard.from_env(ctx.rank, ctx.world_size, float(cfg.communication.timeout_s))
        # rank 0 watches every rank, the others rank 0 (disteval.rank.watchdog)
        ctx.board.watched = list(range(ctx.world_size)) if ctx.rank == 0 else [0]
        ctx.status.mirror = ctx.board.publish
        ctx.board.on_error = lambda err: _store_unreachable(ctx, err)
        ctx.board.on_recovered = lambda: ctx.status.record.get("store_error") and ctx.status.note(store_error=None)
        ctx.status.update(force=True, net=ctx.net)
        ctx.board.publish_now(dict(ctx.status.record))
        shared = detect_shared_filesystem(ctx.board, lambda r: read_status(ctx.run_dir, r))
        ctx.filesystem = "shared" if shared else "node-local"
        ctx.status.update(force=True, filesystem=ctx.filesystem)
    log.info("rank %d/%d on %s, backend %s, device %s", ctx.rank, ctx.world_size, ctx.status.record["host"],
             ctx.backend, ctx.device)


def _store_unreachable(ctx: RankContext, error: str) -> None:
    """status.json ``store_error`` {since, error, endpoint}: this rank could not reach the rendezvous store (a
    partition between its node and the store's): evidence the doctor uses to name the node that was cut off."""
    old = ctx.status.record.get("store_error") or {}
    ctx.status.note(store_error={
        "since": old.get("since") or time.time(), "error": error[:300],
        "endpoint": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"})


def _collective_started(ctx: RankContext, op: str, nbytes: int, info: dict) -> None:
    """status.json ``in_flight`` written (and published) before the collective runs: the evidence that survives a
    rank killed or frozen inside it (the role of NCCL's flight recorder): ``op``, ``bytes`` (this rank's
    payload), ``wire_bytes`` (what it moves through this rank's link, ``disteval.comm.collectives.wire_bytes``),
    ``since`` (epoch seconds), ``peers`` (global ranks), ``payload`` ({name, dtype, compressible, ...} for a
    metric state's gather); ``bytes_done`` / ``t_done`` as pieces finish (``_collective_progress``)."""
    flight = {"op": op, "bytes": nbytes, "since": time.time(), "bytes_done": 0, **info}
    ctx.status.update(force=True, last_collective={"op": op, "bytes": nbytes}, in_flight=flight)


def _collective_progress(ctx: RankContext, done: int) -> None:
    """status.json ``in_flight.bytes_done`` / ``t_done``: a piece of the collective under way finished (written at
    the status interval; a failure's final write carries the last value)."""
    flight = ctx.status.record.get("in_flight")
    if flight:
        ctx.status.update(in_flight={**flight, "bytes_done": int(done), "t_done": time.time()})


def _collective_finished(ctx: RankContext, record: dict) -> None:
    """status.json: ``in_flight`` cleared, ``collectives_done`` the last finished ones {op, bytes, wire_bytes,
    seconds, t_end} (achieved throughput per collective: the doctor tells a slow link from a slow rank with it)."""
    flight = ctx.status.record.get("in_flight") or {}
    if flight.get("op") == record["op"] and flight.get("wire_bytes") is not None and flight.get("bytes"):
        record["wire_bytes"] = int(flight["wire_bytes"] * record["bytes"] / flight["bytes"])
    ctx.status.update(in_flight=None, collectives_done=list(ctx.comm.history)[-8:])


def _network(env: RankEnv | None) -> dict:
    """This rank's place on the network, before the process group exists: the interface gloo/NCCL will use
    (``disteval.common.netif.apply_socket_ifname``: the route to MASTER_ADDR unless GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME are set), host, node identity and node rank. Raises DistevalError when the ranks span
    nodes and MASTER_ADDR resolves to a loopback address (the other nodes could never reach it)."""
    info = {"host": socket.gethostname(), "node": netif.node_id(), "node_rank": 0, "interface": None,
            "address": None, "ifname_source": None}
    if env is None:
        return info
    master = os.environ.get("MASTER_ADDR")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    resolved = netif.resolve(master) if master else None
    if local_world < env.world_size and netif.is_loopback(resolved):
        raise DistevalError(f"rank {env.rank} on node {info['host']}: the ranks span several nodes but MASTER_ADDR="
                            f"{master} resolves to {resolved}, a loopback address; the launcher advertised a "
                            "hostname that resolves to loopback: give it the node's reachable address (torchrun "
                            "--local-addr ADDR / --rdzv-endpoint ADDR:PORT, disteval dist.local_addr=ADDR) or fix "
                            "/etc/hosts")
    chosen = netif.apply_socket_ifname(master)
    info.update(node_rank=launch_env.node_rank(), interface=chosen["interface"],
                address=chosen["address"], ifname_source=chosen["source"])
    return info


def _agree_run_dir(ctx: RankContext) -> None:
    meta = ctx.comm.broadcast_json({"run_dir": ctx.run_dir, "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                                    "seed": int(ctx.cfg.seed), "t_start": ctx.status.record["t_start"]}
                                   if ctx.rank == 0 else None)
    if meta["seed"] != int(ctx.cfg.seed):
        raise DistevalError(f"rank {ctx.rank} has seed={ctx.cfg.seed} but rank 0 has {meta['seed']}: the ranks "
                            "were started with different overrides")
    if meta["run_dir"] != ctx.run_dir:  # move this rank's records next to rank 0's
        old, ctx.run_dir = ctx.status, meta["run_dir"]
        ctx.status = StatusWriter(ctx.run_dir, ctx.rank, ctx.world_size, interval_s=old.interval_s)
        ctx.status.record.update(t_start=old.record["t_start"], rendezvous=old.record.get("rendezvous"),
                                 joined=old.record.get("joined"))
        setup_logging(ctx.run_dir, ctx.rank)


def apply_compute_settings(ctx: RankContext) -> dict:
    """Per-rank compute settings, recorded in results.json ``compute``: ``eval.mode``; intra-op threads
    (``dist.threads``; null = 1 in bitwise mode, the cores shared among local ranks in fast mode); TF32,
    determinism and cuDNN benchmark (off in bitwise mode); and the fast path's model_dtype (autocast),
    channels_last, compile (+ mode) and inference_mode (always: the loop runs under it). Returns the record."""
    cfg = ctx.cfg
    mode = str(cfg.eval.mode)
    threads = cfg.dist.threads
    if threads is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if ctx.env is not None else 1
        threads = 1 if mode == "bitwise" else max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(int(threads))
    with warnings.catch_warnings():
        if ctx.rank != 0:  # say it once
            warnings.simplefilter("ignore")
        prec.apply_global_switches(cfg.precision, ctx.device, bitwise=mode == "bitwise")
    if mode == "bitwise":
        torch.backends.cudnn.benchmark = False
    ctx.compute = {"mode": mode, "threads": int(torch.get_num_threads()),
                   "deterministic": bool(torch.are_deterministic_algorithms_enabled()),
                   "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                   "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                   "model_dtype": prec.model_dtype_name(cfg.precision),
                   "channels_last": bool(cfg.model.channels_last),
                   "compile": bool(cfg.eval.compile),
                   "compile_mode": str(cfg.eval.compile_mode) if cfg.eval.compile else None,
                   "compile_backend": str(cfg.eval.compile_backend) if cfg.eval.compile else None,
                   "inference_mode": True,
                   "decode_on_device": bool(cfg.data.decode_on_device),
                   # the host decoder of image files (pil: the reference pixels; turbo may differ) and whether
                   # the pixels came from the exact pixel cache (the same pixels as the files')
                   "decode": str(cfg.data.decode), "pixel_cache": str(cfg.data.cache)}
    return ctx.compute


def say(ctx: RankContext, message: str) -> None:
    """A start-up progress line on the console (rank 0 only) and in this rank's log."""
    log.info(message)
    if ctx.rank == 0:
        startup.progress(message)
