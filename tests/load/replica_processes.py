"""The Ray Serve replica processes of one local stack, found through /proc: their pids (a replica that crashed and
was replaced has a new pid) and resident memory.

Ray names a replica's worker process `ray::ServeReplica:<app>:<deployment>`; the stack's own processes (raylet,
workers) descend from the `python -m genserve.services.serve` process, so walking the parent links from it keeps another
stack on the same machine out of the picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TITLE_PREFIX = "ray::ServeReplica:"


@dataclass(frozen=True)
class Replica:
    pid: int
    app: str
    deployment: str
    rss_kib: int


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:  # the process ended while we looked
        return None


def status_field(pid: int, field: str) -> int | None:
    """A numeric field of /proc/<pid>/status in kB (VmRSS, VmHWM, PPid...), None when the process is gone."""
    text = _read(PROC / str(pid) / "status")
    for line in (text or "").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _parents() -> dict[int, int]:
    parents = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (ppid := status_field(int(entry.name), "PPid")) is not None:
            parents[int(entry.name)] = ppid
    return parents


def descendants(root: int) -> set[int]:
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def parse_title(cmdline: str) -> tuple[str, str] | None:
    """(app, deployment) from a replica's process title, None for any other process. While a method runs, Ray
    appends it to the title (`...:Diffusion.handle_request_with_rejection`)."""
    title = cmdline.replace("\x00", " ").strip()
    if not title.startswith(TITLE_PREFIX):
        return None
    parts = (title.removeprefix(TITLE_PREFIX).split() or [""])[0].split(":")
    return (parts[0], parts[1].split(".")[0]) if len(parts) >= 2 and parts[0] and parts[1] else None


def replicas(root: int) -> list[Replica]:
    """Every live replica process below `root` (the stack's serve process), sorted by app and pid."""
    found = []
    for pid in descendants(root):
        names = parse_title(_read(PROC / str(pid) / "cmdline") or "")
        rss = status_field(pid, "VmRSS")
        if names is not None and rss is not None:
            found.append(Replica(pid, *names, rss))
    return sorted(found, key=lambda r: (r.app, r.pid))


def pids_by_app(root: int) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for replica in replicas(root):
        out.setdefault(replica.app, set()).add(replica.pid)
    return out
