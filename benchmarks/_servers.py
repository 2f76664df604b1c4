"""Starting servers for the benchmark scripts: xlaserve over a generated repository, and the
peers of ../shared/peers (their run_*.sh install into $PEERS_ROOT on first use). Also: a
process tree's CPU seconds, so scripts can report server CPU per request."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("XLASERVE_PEERS_DIR", ROOT.parent / "shared" / "peers"))


def export_mlp_as(repo: Path, name: str, sizes) -> Path:
    """The example ``mlp`` bundle under another name, with the given compiled batch sizes."""
    from examples.export_examples import export_img_mean, export_mlp
    with tempfile.TemporaryDirectory() as tmp:
        exporter = export_img_mean if name == "img_mean" else export_mlp
        src = exporter(Path(tmp), tuple(sizes))
        dst = repo / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    manifest = yaml.safe_load((dst / "manifest.yaml").read_text())
    manifest["name"] = name
    (dst / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return dst


def batch_device_seconds(stats) -> float:
    """Device seconds of a model's executions so far: the compute durations of every batch size
    in its ModelStatistics ``batch_stats``."""
    return sum(b.compute_input.ns + b.compute_infer.ns + b.compute_output.ns for b in stats.batch_stats) / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held together while chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def consecutive_free_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` both free (a two-worker node's base ports)."""
    for _ in range(100):
        base = free_port()
        if base >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


@contextmanager
def xlaserve(repo: Path, scheduler: dict | None = None, log_path: Path | None = None, timeout: float = 300,
             source: Path = ROOT, top: dict | None = None):
    """Run ``xlaserve run`` on ``repo``; yields (url, pid). ``source``: the checkout whose
    ``xlaserve`` runs (another commit's, to compare with); ``top``: more top-level blocks of the
    node file (``tracing``)."""
    work = Path(tempfile.mkdtemp(prefix="xlaserve-bench-"))
    node = {"model_repo": str(repo), "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"},
            "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static",
                       "scheduler": scheduler or {}}, **(top or {})}
    (work / "node.yaml").write_text(yaml.safe_dump(node))
    ready = work / "ready.json"
    log = open(log_path or work / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", "--log-level", "warning", "run",
                             str(work / "node.yaml"), "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=source)
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"xlaserve did not start; see {log.name}")
            time.sleep(0.1)
        port = json.loads(ready.read_text())["grpc_port"]
        url = f"127.0.0.1:{port}"
        wait_ready(url, deadline)
        yield url, proc.pid
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def peer(name: str, log_dir: Path, timeout: float = 1200):
    """Run ``run_<name>.sh`` from the peers folder; yields (url, pid)."""
    port = free_port()
    while port + 1 > 65535 or not _free(port - 1) or not _free(port + 1):
        port = free_port()
    log = open(log_dir / f"{name}.log", "w")
    proc = subprocess.Popen(["bash", str(PEERS / f"run_{name}.sh"), str(port)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(f"127.0.0.1:{port}", time.monotonic() + timeout, proc)
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        stop(proc, group=True)
        log.close()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def wait_ready(url: str, deadline: float, proc: subprocess.Popen | None = None,
               models: tuple[str, ...] = ()) -> None:
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server at {url} exited with {proc.returncode}")
        try:
            if client.is_server_ready() and all(client.is_model_ready(m) for m in models):
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server at {url} not ready in time")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, group: bool = False) -> None:
    if proc.poll() is not None:
        return
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait()


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Hold every thread of process ``pid`` to ``cpus`` (threads started later inherit it from
    the thread that starts them)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in threads:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:         # a thread that ended meanwhile
            pass


def pin_tree(pid: int, cpus: set[int]) -> None:
    """:func:`pin_threads` for ``pid`` and each of its descendants."""
    for p in tree_pids(pid):
        pin_threads(p, cpus)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid = int(fields[1])
        children.setdefault(ppid, []).append(int(entry))
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo += children.get(p, [])
    return total
