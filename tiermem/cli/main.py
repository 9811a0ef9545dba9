"""The ``tiermem`` command: ``serve`` (the store as a service), ``top`` and ``stats`` (watch a run or a
service), ``probe`` (measure this machine's links) and ``arenas`` (list or clean shared-memory arenas left
behind). A user error prints one line and exits with code 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tiermem.errors import UserError, printable
from tiermem.sizes import format_size, parse_size


def _probe(args) -> int:
    from tiermem.cli.probe import render, run_probe

    size = parse_size(args.size, "--size")
    if size < (1 << 20):
        raise UserError("--size must be at least 1MiB")
    if not 1 <= args.reps <= 1000:
        raise UserError(f"--reps must be from 1 to 1000 (the median of that many measurements), got {args.reps}")
    arena_size = parse_size(args.arena_size, "--arena-size") if args.arena_size else None
    if args.nvme_path:  # created when its parent exists, as tiers.nvme.path is
        from tiermem.tiers.nvme import check_directory

        for d in args.nvme_path:
            check_directory(Path(d), 2 * size)
    result = run_probe(size, args.nvme_path, args.arena_dir, args.reps, arena_size)
    if args.save:
        from tiermem.cli.probe import save

        save(result, args.save)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        render(result)
    return 0


def _recoverable(arena) -> str:
    """For an arena a service left behind with its run recorded: how to recover it ('' for none). Where the run is
    recorded comes from the arena's own header (its owner's state directory), else from the lock file beside it."""
    from tiermem.service.journal import default_state_dir, recoverable_run
    from tiermem.service.owner import lock_path, read_note
    from tiermem.service.protocol import default_socket

    note = read_note(lock_path(arena.path.parent, arena.name))
    for directory in (arena.owner.get("state_dir"), note.get("state_dir"), default_state_dir()):
        run = recoverable_run(Path(str(directory)), arena.name, arena.path.parent) if directory else None
        if run is not None:
            config = run["config"] or arena.owner.get("config") or note.get("config")
            socket = arena.owner.get("socket")  # (the service's, said where it was not the default)
            socket = f" --socket {socket}" if socket and Path(str(socket)) != default_socket() else ""
            start = (f"`tiermem serve --config {config}{socket}`" if config
                     else f"`tiermem serve` with store {arena.name}'s config")
            return f"recoverable: start {start} to recover " + (f"step {run['step']}" if run["step"] is not None
                                                                  else "its run")
    return ""


def _remove(arena) -> None:
    """Remove an arena left behind, unless a service has taken its store meanwhile (a service's arena, its header
    says, is removed holding the store's lock, even where the lock file is gone)."""
    from tiermem.service.owner import Owned, Ownership, lock_path

    if arena.owner.get("kind") != "service" and not lock_path(arena.path.parent, arena.name).exists():  # (a run's
        arena.path.unlink(missing_ok=True)
        print(f"  removed {arena.path}")
        return
    try:
        with Ownership.take(arena.name, [arena.path.parent]):
            arena.path.unlink(missing_ok=True)
    except Owned as e:
        print(f"  kept: tiermem service pid {e.pid} has taken it")
        return
    print(f"  removed {arena.path}")


def _arenas(args) -> int:
    from tiermem.tiers.arena_files import SUFFIX, header_problem, list_arenas

    if args.force and not args.clean:
        raise UserError("--force goes with --clean: `tiermem arenas --clean --force`")
    arenas = list_arenas(args.dir)
    listed = {a.path for a in arenas}
    skipped = [p for p in sorted(Path(args.dir).glob(f"*{SUFFIX}")) if p not in listed]
    for p in skipped:  # (one malformed file must not hide the others)
        print(f"note: skipped {p}: {header_problem(p) or 'it changed while it was read'}")
    if args.name is not None:  # (one store's: what a stopped service says to free, leaving the others' alone)
        arenas = [a for a in arenas if a.name == args.name]
        if not arenas:
            print(f"no tiermem arena of store {args.name} in {args.dir}")
    elif not arenas:
        print(f"no tiermem arenas in {args.dir}")
    for a in arenas:
        recoverable = "" if a.alive else _recoverable(a)
        state = "running" if a.alive else "left behind" + (f"; {recoverable}" if recoverable else "")
        print(f"{a.path}  {format_size(a.size)}  pid {a.pid} ({state})")
        if args.clean and not a.alive:
            if recoverable and not args.force:
                where = "" if Path(args.dir).resolve() == Path("/dev/shm") else f" --dir {args.dir}"
                print(f"  kept: it holds a run's state; `tiermem arenas{where} --clean --force --name {a.name}` "
                      "removes it (the run then resumes from its newest checkpoint)")
                continue
            _remove(a)
    return 0


def _reader(args):
    """Where top and stats read snapshots: an embedded run's directory, else a service's socket."""
    from tiermem.cli.top import read_service, read_snapshot
    from tiermem.service.protocol import default_socket

    if args.run and args.socket:
        raise UserError("give --run OUTPUT_DIR (an embedded run) or --socket PATH (a service), not both")
    if args.run:
        return lambda: read_snapshot(args.run)
    path = args.socket or default_socket()
    timeout = getattr(args, "timeout", None)
    return lambda: read_service(path, timeout)


def _serve(args) -> int:
    from tiermem.faults import install_from_env
    from tiermem.service.server import serve

    install_from_env()
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        raise UserError(f"--metrics-port must be a TCP port from 1 to 65535, got {args.metrics_port}")
    if args.socket:
        from tiermem.service.protocol import check_socket_path

        check_socket_path(args.socket)
    if args.metrics_port is not None:
        from tiermem.cli.metrics import serve_metrics

        serve_metrics(args.metrics_port, _reader(argparse.Namespace(run=None, socket=args.socket)),
                      args.metrics_addr)
    return serve(args.config, args.socket, args.fresh)


def _top(args) -> int:
    from tiermem.cli.top import top

    return top(_reader(args), args.once, args.probe)


def _stats(args) -> int:
    from tiermem.cli.metrics import prometheus

    snap = _reader(args)()
    print(prometheus(snap) if args.prometheus else json.dumps(snap, indent=1), end="" if args.prometheus else "\n")
    return 0


def plugin(name: str):
    """The ``tiermem.commands`` entry point ``name`` (a command another package adds: ``plan`` is the
    trainer's, since planning a training run needs its model and data code), or None."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="tiermem.commands"):
        if ep.name == name:
            return ep.load()
    return None


def _plugin(args) -> int:
    fn = plugin(args.command)
    if fn is None:
        raise UserError(f"`tiermem {args.command}` comes with the trainer: install the project (pip install -e .), "
                        f"or run python -m trainer.plan_cli")
    return fn(args.rest)


TIMEOUT_HELP = ("seconds without a word from the service before giving up on it (a live one says it is alive every "
                "second; default $TIERMEM_SERVICE_TIMEOUT or 30)")


# what each command's own --help says first (`tiermem --help` lists their one-line summaries)
DESCRIPTIONS = {
    "probe": "Measures the links the store moves state over (the pinned DRAM arena to and from the GPU, the disk to "
             "and from the arena, the arena's setup), through tiermem and raw: the median of --reps runs each. "
             "--save FILE writes the figures the planner reads (tiermem plan --probe FILE). Without CUDA the GPU's "
             "links and the pinning are not measured, and the table says so.",
    "arenas": "Lists the DRAM arenas (shared-memory files) in --dir with their size and owner, and which were left "
              "behind by a process that is gone; --clean removes those (not one a service can recover a run from, "
              "unless --force).",
    "serve": "Runs the store as a service: trainers attach to it (tiermem_server in their YAML) and their state "
             "outlives them. It listens on --socket until SIGTERM or Ctrl-C.",
    "top": "A live view of a run's store (an embedded run's --run OUTPUT_DIR, or a service's socket): its tiers, "
           "links, step and waits; --once prints one frame.",
    "stats": "One snapshot of a run's store (an embedded run's --run OUTPUT_DIR, or a service's socket), as JSON or "
             "in the Prometheus text format.",
}


def _command(sub, name: str, summary: str) -> argparse.ArgumentParser:
    """The subcommand ``name``: ``summary`` in `tiermem --help`, its description in its own --help."""
    return sub.add_parser(name, help=summary, description=DESCRIPTIONS[name])


def build_parser() -> argparse.ArgumentParser:
    from tiermem import __version__

    p = argparse.ArgumentParser(prog="tiermem", description=__doc__.replace("``", ""))
    p.add_argument("--version", action="version", version=f"tiermem {__version__}")
    sub = p.add_subparsers(dest="command", required=True, help="the command (each takes --help)")
    pr = _command(sub, "probe", "measure every link on this machine, through tiermem and raw")
    pr.add_argument("--size", default="2GiB", help="bytes per transfer (default 2GiB)")
    pr.add_argument("--nvme-path", action="append", help="directory on the disk to measure (default: a temporary one "
                    "in .); given several times, the disks striped together, as a tiers.nvme.path list is")
    pr.add_argument("--arena-dir", default="/dev/shm", help="where the DRAM arena file goes")
    pr.add_argument("--arena-size", help="size of the arena whose setup time is measured (default --size)")
    pr.add_argument("--reps", type=int, default=3, help="repetitions per figure; the median is shown")
    pr.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pr.add_argument("--save", help="also write a machine file (docs/machines.md; YAML, JSON if it ends in .json) "
                                   "of what it measured: tiermem plan --machine FILE reads it")
    pr.set_defaults(fn=_probe)
    ar = _command(sub, "arenas", "list shared-memory arenas, and which were left behind")
    ar.add_argument("--dir", default="/dev/shm", help="the directory of the arenas (default /dev/shm)")
    ar.add_argument("--clean", action="store_true",
                    help="remove arenas whose owner is gone, except those a service can recover a run from")
    ar.add_argument("--force", action="store_true",
                    help="with --clean, remove recoverable arenas too (their runs' state is lost: they resume from "
                         "their newest checkpoints)")
    ar.add_argument("--name", help="only the arena of the store NAME (its config's name: NAME.arena)")
    ar.set_defaults(fn=_arenas)
    sv = _command(sub, "serve", "run the store as a service that trainers attach to (tiermem_server=PATH)")
    sv.add_argument("--config", required=True, help="the tiermem config (tiers, placement, name)")
    sv.add_argument("--socket", help="the control socket's path (default: $XDG_RUNTIME_DIR/tiermem/tiermem.sock "
                                     "or /tmp/tiermem-UID/tiermem.sock)")
    sv.add_argument("--fresh", action="store_true", help="discard the run a previous service left behind")
    sv.add_argument("--metrics-port", type=int, metavar="N",
                    help="also serve Prometheus metrics over HTTP on port N (GET /metrics)")
    sv.add_argument("--metrics-addr", default="127.0.0.1",
                    help="the address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for every one)")
    sv.set_defaults(fn=_serve)
    tp = _command(sub, "top", "a live view of a run's store: tiers, links, step, waits")
    tp.add_argument("--run", metavar="OUTPUT_DIR", help="follow the embedded run writing to OUTPUT_DIR")
    tp.add_argument("--socket", help="a tiermem service's socket (default: this user's default socket)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    tp.add_argument("--probe", help="a `tiermem probe --save` file: show each link's measured ceiling")
    tp.add_argument("--timeout", type=float, metavar="S", help=TIMEOUT_HELP)
    tp.set_defaults(fn=_top)
    st = _command(sub, "stats", "one snapshot of a run's store, for scripts")
    st.add_argument("--run", metavar="OUTPUT_DIR", help="the embedded run writing to OUTPUT_DIR")
    st.add_argument("--socket", help="a tiermem service's socket (default: this user's default socket)")
    st.add_argument("--timeout", type=float, metavar="S", help=TIMEOUT_HELP)
    fmt = st.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="JSON (the default)")
    fmt.add_argument("--prometheus", action="store_true", help="Prometheus text format")
    st.set_defaults(fn=_stats)
    pl = sub.add_parser("plan", add_help=False,
                        help="what a training run would do on this machine: placement, predicted step, advice "
                             "(tiermem plan TRAIN.yaml [key=value ...] [--json] [--probe FILE | --machine FILE]; "
                             "tiermem plan --machine FILE --largest TRAIN.yaml; --help for more)")
    pl.add_argument("rest", nargs=argparse.REMAINDER, help="TRAIN.yaml [key=value ...] [--json] [--probe FILE]")
    pl.set_defaults(fn=_plugin)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # (all the rest is the plugin's, options first too: argparse's REMAINDER takes
        args = argparse.Namespace(command="plan", rest=argv[1:], fn=_plugin)  # none that starts with --)
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"tiermem: error: {printable(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
