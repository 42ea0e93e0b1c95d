"""Memory allocator policy of the rank processes (``dist.allocator``): which ``malloc`` a rank runs with.

Why: with glibc's default malloc, an identical evaluation process was randomly 1.5x slower or faster here
(600-740k minor page faults per pass against 20-110k): glibc's dynamic mmap threshold and heap trimming
return the big activation/batch buffers to the kernel after each batch and fault them in again on the
next one. tcmalloc and jemalloc keep such memory; so does glibc with raised thresholds (fashion-mnist
throughput +46-49%, measured before this module existed; ``benchmarks/allocator.py`` measures it again).

Policies (``POLICIES``):

- ``auto`` (default): tcmalloc where its library is installed, else jemalloc, else ``glibc-tuned`` (at world
  size 1 the CLI keeps the rank in its own process under ``auto``: no second process for the allocator alone);
- ``system``: glibc's malloc as it is (nothing added to the environment);
- ``glibc-tuned``: glibc's malloc with ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:
  glibc.malloc.trim_threshold=1073741824`` (a fixed 32 MiB mmap threshold, the largest glibc accepts on
  64-bit, which also turns its dynamic adjustment off; free memory at the top of the heap is returned to the
  kernel only beyond 1 GiB);
- ``tcmalloc`` / ``jemalloc``: the library preloaded (``LD_PRELOAD``); an error naming the Debian package
  when it is not installed (it is looked for, never downloaded). jemalloc also gets
  ``MALLOC_CONF=dirty_decay_ms:-1`` (freed pages are kept for reuse, never purged): with jemalloc 5.3's
  defaults (Debian's libjemalloc2; dirty pages decay over 10 s, larger allocations in an eagerly purged
  arena) the Fashion-MNIST job faulted as many pages per pass as glibc's default malloc (about 650k) and ran
  no faster; ``oversize_threshold:0`` or longer decay times did not change that, ``dirty_decay_ms:-1`` did.

Both variables are read only when a process is exec'd (the dynamic loader reads LD_PRELOAD and
GLIBC_TUNABLES before ``main``), so a launcher must put them into the environment the ranks are *started*
with (``AllocatorChoice.applied``); setting them inside a running process changes nothing. The driver
(``python -m disteval``) keeps the allocator it was started with.

Sources: PyTorch's CPU performance tuning guide ("Switch Memory allocator": tcmalloc/jemalloc through
LD_PRELOAD, https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html) and glibc's manual, "Memory
Allocation Tunables" (glibc.malloc.mmap_threshold, glibc.malloc.trim_threshold, the GLIBC_TUNABLES syntax
``name=value:name=value``; https://www.gnu.org/software/libc/manual/html_node/Memory-Allocation-Tunables.html).

``in_force()`` reports what a process REALLY runs with (the libraries mapped into it, the GLIBC_TUNABLES of
the environment it was exec'd with), not what was asked for; results.json's ``allocator`` comes from it.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Mapping, Sequence, get_args

from disteval.errors import ConfigError

Policy = Literal["auto", "system", "glibc-tuned", "tcmalloc", "jemalloc"]
POLICIES: tuple[str, ...] = get_args(Policy)
KEY = "dist.allocator"

# glibc's malloc tunables of ``glibc-tuned`` (glibc manual, Memory Allocation Tunables)
GLIBC_TUNED = {"glibc.malloc.mmap_threshold": "33554432", "glibc.malloc.trim_threshold": "1073741824"}
# jemalloc's options (MALLOC_CONF, ``name:value,...``; jemalloc(3), "TUNING.md" of jemalloc's repository)
JEMALLOC_CONF = {"dirty_decay_ms": "-1"}

# file names looked for, preferred first, and the Debian package that installs the first one
LIBRARIES = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so.1", "libjemalloc.so"),
}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
_MAPPED = {"tcmalloc": re.compile(r"/libtcmalloc[^/]*\.so[^/]*$"), "jemalloc": re.compile(r"/libjemalloc[^/]*\.so[^/]*$")}

# the variable a launcher adds next to the allocator's own: what it applied (read by ``rank_record``)
APPLIED_VAR = "DISTEVAL_ALLOCATOR"


def search_dirs() -> list[str]:
    """Where ``find_library`` looks, in order: LD_LIBRARY_PATH, this Python's prefix (a conda/venv env's
    lib/), the multiarch and standard library directories (Debian: /usr/lib/x86_64-linux-gnu)."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs.append(str(Path(sys.prefix) / "lib"))
    for base in ("/usr/local/lib", "/usr/lib", "/lib"):
        if multiarch:
            dirs.append(f"{base}/{multiarch}")
        dirs.append(base)
    dirs += ["/usr/lib64", "/lib64"]
    return list(dict.fromkeys(dirs))


def _ldconfig_cache() -> dict[str, str]:
    """{file name: path} from ``ldconfig -p`` (the dynamic loader's cache); {} when ldconfig is absent."""
    for exe in ("/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"):
        try:
            out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found = {}
        wide = sys.maxsize > 2**32
        for line in out.splitlines():  # "\tlibjemalloc.so.2 (libc6,x86-64) => /lib/x86_64-linux-gnu/libjemalloc.so.2"
            m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)", line)
            if m and ("64" in m.group(2)) == wide:
                found.setdefault(m.group(1), m.group(3))
        return found
    return {}


def find_library(name: str, dirs: Sequence[str] | None = None) -> str | None:
    """The path of ``name``'s shared library (``tcmalloc`` or ``jemalloc``), or None. Looks in ``dirs``
    (default ``search_dirs()``, then the ldconfig cache); only installed files, nothing is downloaded."""
    files = LIBRARIES[name]
    for d in (search_dirs() if dirs is None else dirs):
        for f in files:
            path = Path(d) / f
            if path.is_file():
                return str(path)
    if dirs is None:
        cache = _ldconfig_cache()
        for f in files:
            if f in cache and Path(cache[f]).is_file():
                return cache[f]
    return None


def parse_tunables(value: str | None) -> dict[str, str]:
    """``name=value:name=value`` (GLIBC_TUNABLES) as an ordered dict."""
    return _pairs(value, ":", "=")


def _pairs(value: str | None, sep: str, kv: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (value or "").split(sep):
        if kv in item:
            k, v = item.split(kv, 1)
            out[k.strip()] = v.strip()
    return out


def _merged(var: str, environ: Mapping[str, str], ours: dict[str, str], sep: str, kv: str) -> dict[str, str]:
    """{var: the user's value with ``ours`` added for the keys it lacks (theirs win)}, {} when nothing is added."""
    user = _pairs(environ.get(var), sep, kv)
    added = {k: v for k, v in ours.items() if k not in user}
    return {var: sep.join(f"{k}{kv}{v}" for k, v in {**user, **added}.items())} if added else {}


def _preloads(value: str | None) -> list[str]:
    """LD_PRELOAD's entries (ld.so separates them by spaces or colons)."""
    return [p for p in re.split(r"[\s:]+", value or "") if p]


def _allocator_of(path: str) -> str | None:
    return next((n for n, pat in _MAPPED.items() if pat.search("/" + path.lstrip("/"))), None)


@dataclass(frozen=True)
class AllocatorChoice:
    """What ``resolve`` picked. ``requested``: the policy asked for; ``name``: system | glibc-tuned | tcmalloc
    | jemalloc; ``library``: the preloaded library's path (None for glibc); ``env``: the variables to add to a
    rank's environment (merged with the values of the environment it was resolved against; empty when that
    environment already gives the choice); ``note``: why the choice differs from the request, if it does."""

    requested: str
    name: str
    library: str | None = None
    env: dict = field(default_factory=dict)
    note: str | None = None

    @property
    def changes_env(self) -> bool:
        """Whether a process started with ``env`` runs with another allocator than its parent."""
        return bool(self.env)

    def launch_env(self) -> dict[str, str]:
        """``env`` plus ``DISTEVAL_ALLOCATOR`` (the name, read back by ``rank_record``): what a launcher puts
        into the environment the ranks are exec'd with."""
        return {**self.env, APPLIED_VAR: self.name}

    def shell_exports(self) -> list[str]:
        """``export NAME=value`` lines (shell-quoted) of ``launch_env()``, for a job script."""
        import shlex

        return [f"export {k}={shlex.quote(v)}" for k, v in self.launch_env().items()]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """``launch_env()`` in ``os.environ`` for the duration of the block (processes exec'd inside it start
        with it), then every variable restored or removed again, also on errors. Does not change this
        process's own allocator (LD_PRELOAD and GLIBC_TUNABLES are read only at exec). Not thread-safe with
        respect to other threads reading os.environ or starting processes meanwhile."""
        env = self.launch_env()
        saved = {k: os.environ.get(k) for k in env}
        try:
            os.environ.update(env)
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _missing(name: str) -> ConfigError:
    return ConfigError(KEY, f"{name} requested but its library ({', '.join(LIBRARIES[name][:2])}) is not installed; "
                       f"install the Debian package: apt-get install {PACKAGES[name]} (or pick auto | system | "
                       "glibc-tuned)")


def resolve(policy: str, environ: Mapping[str, str] | None = None, dirs: Sequence[str] | None = None) -> AllocatorChoice:
    """The allocator ``policy`` gives on this machine, and the environment variables that start a process
    with it, merged with ``environ`` (default ``os.environ``): the library is put before the entries of an
    existing LD_PRELOAD, the tunables join an existing GLIBC_TUNABLES whose own keys win. ``dirs``: where to
    look for the libraries (default: ``search_dirs()`` and the ldconfig cache).

    An allocator library already in ``environ``'s LD_PRELOAD is the user's choice: ``auto`` keeps it, an
    explicit request for another one is refused. Raises ConfigError naming ``dist.allocator`` (and the Debian
    package) for an unknown policy or an explicitly requested library that is not installed."""
    environ = os.environ if environ is None else environ
    if policy not in POLICIES:
        raise ConfigError(KEY, f"{policy!r} is not one of {list(POLICIES)}")
    preloaded = [(a, p) for p in _preloads(environ.get("LD_PRELOAD")) if (a := _allocator_of(p))]
    if preloaded:
        user, path = preloaded[0]
        if policy in ("auto", user):
            return AllocatorChoice(policy, user, path, {}, "already in LD_PRELOAD")
        if policy in ("tcmalloc", "jemalloc"):
            raise ConfigError(KEY, f"{policy} requested but LD_PRELOAD already preloads {user} ({path}); two "
                              "allocators cannot both be in force: unset LD_PRELOAD or ask for dist.allocator=auto")
        # system / glibc-tuned with a preloaded allocator: the user's LD_PRELOAD stays (it is theirs); say so
        return AllocatorChoice(policy, user, path, {}, f"LD_PRELOAD already preloads {user}: it stays in force")
    if policy == "system":
        return AllocatorChoice(policy, "system")
    candidates = ("tcmalloc", "jemalloc") if policy == "auto" else ((policy,) if policy != "glibc-tuned" else ())
    for name in candidates:
        library = find_library(name, dirs)
        if library is not None:
            env = {"LD_PRELOAD": ":".join([library, *_preloads(environ.get("LD_PRELOAD"))])}
            if name == "jemalloc":
                env.update(_merged("MALLOC_CONF", environ, JEMALLOC_CONF, ",", ":"))
            return AllocatorChoice(policy, name, library, env)
        if policy != "auto":
            raise _missing(name)
    env = _merged("GLIBC_TUNABLES", environ, GLIBC_TUNED, ":", "=")
    note = None if policy == "glibc-tuned" else \
        f"neither tcmalloc nor jemalloc installed (apt-get install {PACKAGES['tcmalloc']} or {PACKAGES['jemalloc']})"
    return AllocatorChoice(policy, "glibc-tuned", None, env, note)


def _initial_environ(path: str = "/proc/self/environ") -> dict[str, str] | None:
    """The environment this process was exec'd with (what the dynamic loader saw), None when unreadable."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def _start_tunables(start_env: dict[str, str] | None) -> str | None:
    """GLIBC_TUNABLES as the dynamic loader saw it at exec. The loader parses the exec'd environment block in
    place (glibc 2.36 leaves only the first ``name=value`` there, /proc/self/environ shows it) and hands the
    process a copy of the full value (``os.environ``'s at start): the full value when it extends what the
    block holds, the block's when the variable was changed since, None when it was set only after the start."""
    current = os.environ.get("GLIBC_TUNABLES")
    if start_env is None:
        return current or None
    if "GLIBC_TUNABLES" not in start_env:
        return None
    first = start_env["GLIBC_TUNABLES"]
    return (current if current and current.startswith(first) else first) or None


def mapped_allocators(maps: str = "/proc/self/maps") -> dict[str, str]:
    """{tcmalloc | jemalloc: library path} of the allocator libraries mapped into this process."""
    found: dict[str, str] = {}
    try:
        text = Path(maps).read_text()
    except OSError:
        return found
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and (name := _allocator_of(parts[5].strip())):
            found.setdefault(name, parts[5].strip())
    return found


def in_force(maps: str = "/proc/self/maps", environ: str = "/proc/self/environ") -> dict:
    """What THIS process really runs with: {in_force: tcmalloc | jemalloc | glibc-tuned | system, library:
    the mapped allocator library or None, glibc_tunables: GLIBC_TUNABLES of the environment it was exec'd
    with (or None), malloc_conf: jemalloc's MALLOC_CONF from that environment when jemalloc is in force}.
    tcmalloc/jemalloc when its library is mapped (read from /proc/self/maps); glibc-tuned
    when glibc's malloc runs with ``glibc.malloc.*`` tunables; else system."""
    libs = mapped_allocators(maps)
    start_env = _initial_environ(environ)
    tunables = _start_tunables(start_env)
    if libs:
        name = next(iter(libs))
        conf = (start_env if start_env is not None else os.environ).get("MALLOC_CONF") if name == "jemalloc" else None
        return {"in_force": name, "library": libs[name], "glibc_tunables": tunables, "malloc_conf": conf or None}
    tuned = any(k.startswith("glibc.malloc.") for k in parse_tunables(tunables))
    return {"in_force": "glibc-tuned" if tuned else "system", "library": None, "glibc_tunables": tunables,
            "malloc_conf": None}


def rank_record(requested: str) -> dict:
    """A rank's ``allocator`` fact: {requested (dist.allocator), applied (what the launcher put into the
    environment this process was started with, None when no disteval launcher started it), in_force,
    library, glibc_tunables}."""
    start_env = _initial_environ()
    applied = (start_env if start_env is not None else os.environ).get(APPLIED_VAR)
    return {"requested": str(requested), "applied": applied or None, **in_force()}


def summarize(records: Sequence[dict | None]) -> dict | None:
    """results.json ``allocator`` from every rank's ``rank_record`` (rank order): rank 0's record plus
    ``ranks_agree``; when the ranks disagree on what is in force, ``per_rank`` lists every record; ``warning``
    when an allocator was applied but another one is in force on some rank. None without records."""
    recs = [r for r in records if r]
    if not recs:
        return None
    first = dict(recs[0])
    keys = ("in_force", "library", "glibc_tunables", "malloc_conf")
    agree = all(tuple(r.get(k) for k in keys) == tuple(first.get(k) for k in keys) for r in recs)
    out = {**first, "ranks_agree": agree}
    if not agree or len(recs) != len(records):
        out["per_rank"] = list(records)
    off = [i for i, r in enumerate(records) if r and r.get("applied") and r.get("in_force") != r.get("applied")]
    if off:
        out["warning"] = (f"dist.allocator: {first.get('applied')} was applied but rank(s) {off} run with "
                          f"{sorted({records[i]['in_force'] for i in off})} (library missing on that host?)")
    return out


__all__ = ["APPLIED_VAR", "AllocatorChoice", "GLIBC_TUNED", "JEMALLOC_CONF", "PACKAGES", "POLICIES", "Policy", "find_library",
           "in_force", "mapped_allocators", "parse_tunables", "rank_record", "resolve", "search_dirs", "summarize"]
