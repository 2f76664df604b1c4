"""The ``xlaserve`` command: ``run`` and ``worker`` serve a node file, ``top`` watches a worker,
``bench`` loads any KServe V2 server. ``--help`` says what xlaserve is and where its manual is."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from xlaserve.config import ConfigError, load_node_config, resolve_worker
from xlaserve.cpupolicy import apply_policy, restore_worker_policy


# Libraries whose INFO lines are not news to an operator: JAX probing for platforms it will not
# use ("Unable to initialize backend 'tpu'"), watchfiles announcing every file change (the
# lifecycle logs what a change did). They log at WARNING and above unless --log-level debug.
_QUIET_BELOW_DEBUG = ("jax", "watchfiles")


class _CommandHandler(logging.StreamHandler):
    """The stderr handler the command installs, reconfigured once the node file is read."""


def _logging(level: str, log_format: str = "text") -> None:
    """Log at ``level`` in ``log_format`` to stderr. Like ``logging.basicConfig``, it leaves a
    logging configured by someone else (a program calling :func:`main`) as it is."""
    from xlaserve.logformat import formatter
    chosen = getattr(logging, level.upper())
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _CommandHandler)), None)
    if handler is None and not root.handlers:
        handler = _CommandHandler(sys.stderr)
        root.addHandler(handler)
    if handler is not None:
        handler.setFormatter(formatter(log_format))
        root.setLevel(chosen)
    for name in _QUIET_BELOW_DEBUG:
        logging.getLogger(name).setLevel(logging.NOTSET if chosen <= logging.DEBUG
                                         else max(chosen, logging.WARNING))


def _node_logging(args: argparse.Namespace, node) -> None:
    """The node (or gateway) file's ``logging:`` block, where the command line did not choose."""
    if args.log_level is None or args.log_format is None:
        _logging(args.log_level or node.logging.level, args.log_format or node.logging.format)


#: the open-files limit a serving process raises its soft limit to, where the hard one allows
OPEN_FILES_WANTED = 65536


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files toward its hard limit (at most
    :data:`OPEN_FILES_WANTED`). Many systems start processes at a soft limit of 1,024, which one
    client's shared-memory regions (each holds a descriptor, ``MAX_REGIONS`` 1,024) or the
    default ``endpoints.max_connections`` (1,024) reach alone: past it every accept, model load
    and log file fails with EMFILE. The hard limit is the operator's, and stays as it is."""
    import resource
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):       # not allowed here: the limit stays as it was
        pass


def _serving(run) -> int:
    """Run a server; a start-up error is one line on stderr (``xlaserve: cannot start: ...``)
    and exit status 2, like a mistake in the node file, never a traceback. After a clean stop
    the process exits at once (``os._exit``), with its logs flushed."""
    from xlaserve.errors import find_startup_error
    raise_open_files_limit()
    try:
        result = run()
    except BaseException as exc:
        startup = find_startup_error(exc)
        if startup is None:
            raise
        print(f"xlaserve: cannot start: {startup}", file=sys.stderr)
        return 2
    code = result if isinstance(result, int) else 0
    # The server has stopped: its sockets are closed, its files written. What remains is the
    # interpreter tearing down JAX and XLA module by module (0.2-0.4 s measured), which frees
    # nothing the OS does not free at exit; skip it so a SIGTERM ends the process promptly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_run(args: argparse.Namespace) -> int:
    """Serve a one-worker node file; its worker serves the public ports itself."""
    from xlaserve.node import run_node
    try:
        node = load_node_config(args.node, os.environ)
    except ConfigError as exc:
        print(f"xlaserve: {exc}", file=sys.stderr)  # names the file where the mistake is in it
        return 2
    _node_logging(args, node)
    return _serving(lambda: run_node(node, ready_file=args.ready_file, node_path=args.node))


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one worker of a node file, by name or index (any node; the way to run each worker of a
    multi-worker node until a supervisor exists)."""
    from xlaserve.node import run_worker
    try:
        node = load_node_config(args.node, os.environ)
    except ConfigError as exc:
        print(f"xlaserve: {exc}", file=sys.stderr)
        return 2
    try:
        which = int(args.worker) if args.worker.isdigit() else args.worker
        config = resolve_worker(node, which, args.worker_count)
    except ConfigError as exc:
        print(f"xlaserve: {args.node}: {exc}", file=sys.stderr)
        return 2
    _node_logging(args, node)
    restore_worker_policy(os.environ)    # started by a node's supervisor: not its gateway's policy
    return _serving(lambda: run_worker(config, ready_file=args.ready_file))


def cmd_gateway(args: argparse.Namespace) -> int:
    """Run a standalone gateway: the workers of its ``endpoints`` behind one KServe V2 address."""
    import trio

    from xlaserve.config.gateway import load_gateway_file
    from xlaserve.gateway.run import serve_gateway
    try:
        config = load_gateway_file(args.config, os.environ)
    except ConfigError as exc:
        print(f"xlaserve: {exc}", file=sys.stderr)
        return 2
    _node_logging(args, config)      # the file's logging: block, where the command line did not choose
    apply_policy(config.cpu_policy)  # (batch) before the event loop starts its threads: they inherit it
    return _serving(lambda: trio.run(lambda: serve_gateway(config, ready_file=args.ready_file)))


def cmd_top(args: argparse.Namespace) -> int:
    """The operator's dashboard of a worker or a gateway's workers (tui/, docs/top.md); ``--once`` prints one snapshot
    and exits, as JSON with ``--json``, without starting the dashboard."""
    import asyncio
    import json

    from tui import connection
    try:
        address = connection.parse_address(args.address)
    except ValueError as exc:
        print(f"xlaserve top: {exc}", file=sys.stderr)
        return 2
    if args.json and not args.once:
        print("xlaserve top: --json prints one snapshot; use it with --once", file=sys.stderr)
        return 2
    if not args.interval >= connection.MIN_INTERVAL_SECONDS:
        print(f"xlaserve top: --interval must be >= {connection.MIN_INTERVAL_SECONDS} s "
              f"(the worker's fastest stream), got {args.interval:g}", file=sys.stderr)
        return 2
    if not args.once and os.environ.get("TERM", "").lower() in ("dumb", "unknown"):
        # Textual draws with escape sequences whatever TERM says: refused, rather than garbage
        print(f"xlaserve top: TERM={os.environ['TERM']} cannot draw a full-screen dashboard; use --once "
              "(or --once --json), or a terminal that can (NO_COLOR=1 for one without colours)", file=sys.stderr)
        return 2
    if not args.once:
        from tui.app import run_top
        run_top(address, args.interval)
        return 0
    from grpclib.exceptions import GRPCError

    from tui.status import json_ready, once_text, snapshot_dict
    try:
        status = asyncio.run(connection.fetch_status(address))
    except GRPCError as exc:
        from xlaserve.controlchars import show_controls      # the peer's message: text, never an escape
        print(f"xlaserve top: {address} answered {exc.status.name}: {show_controls(exc.message or '')}",
              file=sys.stderr)
        return 1
    except connection.CONNECTION_ERRORS as exc:
        print(f"xlaserve top: cannot reach {address}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(json_ready(snapshot_dict(status)), indent=2, allow_nan=False))
        return 0
    print(once_text(status, str(address)))
    return 0


DESCRIPTION = ("xlaserve serves XLA-compiled models (bundles of StableHLO modules and safetensors weights) over "
               "the KServe V2 gRPC protocol, so Triton and KServe clients work unchanged. Try `xlaserve run "
               "examples/node.yaml` after `python examples/export_examples.py`.")
EPILOG = ("The manual: README.md and docs/ in the xlaserve source tree; start with docs/getting-started.md, "
          "and docs/node-config.md for every key of a node file.")


def version_line() -> str:
    """``xlaserve X.Y.Z (jax A.B.C, jaxlib A.B.C)``, from installed package metadata (JAX is not
    imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"
    return f"xlaserve {of('xlaserve')} (jax {of('jax')}, jaxlib {of('jaxlib')})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xlaserve", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the xlaserve, jax and jaxlib versions and exit")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="default: the node file's logging.level, else info")
    parser.add_argument("--log-format", choices=["text", "json"],
                        help="default: the node file's logging.format, else text")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="serve a node file (several workers: a supervisor and the gateway)")
    p.add_argument("node", help="path of the node YAML file")
    p.add_argument("--ready-file", help="write the bound ports as JSON here once serving (for tests, scripts)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("worker", help="run one worker of a node file")
    p.add_argument("node")
    p.add_argument("--worker", default="0", help="worker name or index (default 0)")
    p.add_argument("--ready-file", help="write the bound ports as JSON here once serving")
    # the supervisor passes the worker count gpus: auto detected (a child cannot count the GPUs
    # its CUDA_VISIBLE_DEVICES hides)
    p.add_argument("--worker-count", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_worker)
    p = sub.add_parser("gateway", help="run a standalone gateway in front of workers (a gateway YAML file)")
    p.add_argument("config", help="path of the gateway YAML file (docs/gateway.md)")
    p.add_argument("--ready-file", help="write the bound ports as JSON here once serving")
    p.set_defaults(func=cmd_gateway)
    p = sub.add_parser("export", help="export a JAX function and its parameters, a Flax model or a PyTorch module "
                                      "as a bundle, verified against it",
                       description="Trace fn(params, *inputs) (or a Flax model, or with --torch a PyTorch module) "
                                   "once per compiled batch size, or once with a symbolic batch (--dynamic-batch), "
                                   "write the bundle, then run every module as the server would and compare it "
                                   "with the source (docs/export.md).")
    from xlaserve.export import cli as export_cli
    export_cli.add_arguments(p)
    p = sub.add_parser("top", help="a live terminal dashboard of a worker or a gateway (docs/top.md)",
                       description="A live dashboard of a worker's models (a gateway's: every worker's), from "
                                   "the WatchStatus stream, with pin/unpin, policy, load/unload and compaction "
                                   "actions.")
    p.add_argument("address", nargs="?", default="localhost:8001",
                   help="the worker's or gateway's gRPC address, HOST:PORT (default localhost:8001)")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between updates (default 1, at least 0.05)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: the snapshot as JSON")
    p.set_defaults(func=cmd_top)
    p = sub.add_parser("bench", help="closed-loop load generator for any KServe V2 gRPC server",
                       description="Closed-loop load at given concurrencies; see xlaserve/bench/loadgen.py.")
    from xlaserve.bench import loadgen
    loadgen.add_arguments(p)
    p.set_defaults(func=loadgen.main)
    args = parser.parse_args(argv)
    _logging(args.log_level or "info", args.log_format or "text")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
