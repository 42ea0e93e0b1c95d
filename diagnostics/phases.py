"""Where a failure happened, from the records alone: the phase of the run a verdict rests on.

A rank's status.json says ``phase`` (init, data, forward, sync, done, failed), ``joined`` (set once the process
group exists) and ``rendezvous`` (written just before the process-group start). A failed rank's phase is
``failed``, so the phase it failed *in* comes from its error: ``error.phase`` when recorded, else the innermost
frame of its traceback that belongs to a known step (the process-group start, building the dataset or model,
the forward loop, the synchronisation). A download that fails while the model is built is a data/model
problem, whatever its message says about names or addresses; only an error raised inside the process-group
start is a rendezvous failure.
"""
from __future__ import annotations

import re
from urllib.parse import urlparse

from diagnostics.evidence import Evidence

PHASES = {
    "preflight": "on the driver, before any rank started",
    "launch": "while the driver started the ranks",
    "init": "in the rank before its process group existed, outside the process-group start",
    "rendezvous": "inside the process-group start (rendezvous)",
    "data": "while building the dataset or the model",
    "forward": "in the forward pass over the shard",
    "sync": "in the final synchronisation",
    "results": "after the synchronisation (coverage, results.json)",
    "scheduler": "in the scheduler, outside the ranks",
    "running": "while the ranks ran",
    "never_started": "before the rank wrote any record",
}

# innermost matching frame wins; function names of this project, torch and torchvision
_FRAME_PHASES = (
    ("rendezvous", {"init_process_group", "_create_c10d_store", "_env_rendezvous_handler", "_tcp_rendezvous_handler",
                    "_store_based_barrier", "_rendezvous_helper", "rendezvous"}),
    ("data", {"dataset", "model", "build_model", "build_dataset", "build_detector", "prepare_data", "get_state_dict",
              "load_state_dict_from_url", "download_url_to_file", "load_state_dict_file", "check_data_root"}),
    ("forward", {"evaluate_shard", "step", "on_batch"}),
    ("sync", {"synchronise", "wait_all_in_sync", "_synchronise", "on_sync"}),
    ("results", {"finish", "write_results", "check_coverage", "build_results"}),
    ("init", {"connect", "open_records", "apply_compute_settings"}),
)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_URL = re.compile(r"https?://[^\s'\"<>()]+")
# a failed fetch: the type or message of an error raised by urllib/torch.hub/requests while downloading
_FETCH_TYPES = {"URLError", "HTTPError", "gaierror", "ContentTooShortError", "SSLError", "ConnectTimeout",
                "ConnectionError", "ReadTimeout"}
_FETCH_TEXT = re.compile(r"urlopen error|Name or service not known|Temporary failure in name resolution|"
                         r"nodename nor servname|HTTP Error \d{3}|Network is unreachable|No route to host", re.I)
_FETCH_FRAMES = {"download_url_to_file", "load_state_dict_from_url", "urlopen", "get_state_dict"}


def frames(tb: str | None) -> list[tuple[str, int, str]]:
    """(file, line, function) of each frame of a Python traceback text, outermost first."""
    return [(f, int(n), fn) for f, n, fn in _FRAME.findall(tb or "")]


def error_phase(status: dict | None, rank: int) -> tuple[str | None, Evidence | None]:
    """The phase rank ``rank`` failed in and the evidence: ``error.phase`` when recorded, else the innermost
    traceback frame of a known step; (None, None) when neither says."""
    err = (status or {}).get("error") or {}
    src = f"ranks/rank{rank}/status.json"
    if err.get("phase") in PHASES:
        return err["phase"], Evidence(src, str(err["phase"]), field="error.phase")
    for file, line, func in reversed(frames(err.get("traceback"))):
        for phase, funcs in _FRAME_PHASES:
            if func in funcs:
                return phase, Evidence(file, f"in {func} ({src} error.traceback)", line=line)
    return None, None


def rank_phase(status: dict | None, rank: int) -> tuple[str | None, Evidence | None]:
    """The phase a rank was in when it stopped. A failed rank: ``error_phase``; without a telling traceback,
    a ``rendezvous`` record without ``joined`` (written just before the process-group start, ``joined`` just
    after it) means inside the start, neither means before it, and after ``joined`` the records do not say
    (None). Any other rank: its recorded ``phase``."""
    if not status:
        return "never_started", Evidence(f"ranks/rank{rank}/status.json", "missing")
    src = f"ranks/rank{rank}/status.json"
    if status.get("phase") == "failed" or status.get("error"):
        phase, ev = error_phase(status, rank)
        if phase:
            return phase, ev
        if status.get("joined"):
            return None, Evidence(src, repr(status.get("joined")), field="joined")
        if status.get("rendezvous"):
            return "rendezvous", Evidence(src, "rendezvous recorded, joined null", field="joined")
        return "init", Evidence(src, "no rendezvous record, joined null", field="joined")
    return status.get("phase"), Evidence(src, str(status.get("phase")), field="phase")


def describe(phase: str | None) -> str:
    return PHASES.get(phase or "", "in a phase the records do not show")


def fetch_failure(err: dict | None) -> bool:
    """The error is a failed download (urllib/torch.hub/requests), by its type, message or traceback frames."""
    if not err:
        return False
    funcs = {fn for _, _, fn in frames(err.get("traceback"))}
    return err.get("type") in _FETCH_TYPES or bool(_FETCH_TEXT.search(str(err.get("message", "")))) or \
        bool(funcs & _FETCH_FRAMES and _FETCH_TEXT.search(str(err.get("traceback", ""))))


def url_in(*texts: str | None) -> tuple[str | None, str | None]:
    """The first http(s) URL in ``texts`` and its host name, or (None, None)."""
    for text in texts:
        m = _URL.search(text or "")
        if m:
            url = m.group(0).rstrip(".,;:")
            return url, urlparse(url).hostname
    return None, None


def weights_url(model_name: str | None, weights: str | None) -> str | None:
    """The download URL of torchvision weights ``model_name``/``weights`` (from torchvision's own table, no
    network), or None when they are not torchvision weights."""
    if not model_name or weights in (None, "", "none", "null", "shipped"):
        return None
    try:
        import torchvision

        return str(torchvision.models.get_model_weights(model_name)[weights].url)
    except Exception:  # noqa: BLE001 - not a torchvision model or weights name: nothing to name
        return None
