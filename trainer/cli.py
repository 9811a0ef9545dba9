"""`tiermem-train CONFIG [key=value ...]`: train a model as a LLaMA-Factory-style YAML describes.

A user mistake (bad config, missing file, bad data row, placement over budget) prints one line per problem
and exits with code 2; nothing is written to output_dir.

Several GPUs of one host: ``torchrun --nproc-per-node N -m trainer.cli CONFIG``, or ``FORCE_TORCHRUN=1
tiermem-train CONFIG`` (``NPROC_PER_NODE`` processes, default the GPUs), as llamafactory-cli does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import traceback

from tiermem.errors import UserError, printable

EPILOG = ("The YAML takes LLaMA-Factory's keys (and Hugging Face TrainingArguments') with their meanings; "
          "`tiermem-train --keys` lists every key: its type, default and meaning, or what tiermem does with it "
          "(docs/config.md has the same).")


def _user_error(e: BaseException) -> UserError | None:
    while e is not None:
        if isinstance(e, UserError):
            return e
        e = e.__cause__ or e.__context__
    return None


# PyTorch's caching allocator with expandable segments: a step's activations come and go beside a GPU tier
# that fills most of HBM, and fixed-size segments fragment it (set the variable yourself to choose otherwise)
ALLOC_CONF = "expandable_segments:True"


def build_parser() -> argparse.ArgumentParser:
    from tiermem import __version__

    parser = argparse.ArgumentParser(prog="tiermem-train", description=__doc__.split("\n\n")[0].replace("`", ""),
                                     epilog=EPILOG)
    parser.add_argument("config", nargs="?", help="training YAML (LLaMA-Factory keys)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="optional overrides of the YAML's keys (values read as YAML), e.g. learning_rate=2e-5 "
                             "or tiermem.tiers.dram.budget=64GiB")
    parser.add_argument("--preview", type=int, metavar="N",
                        help="print the first N processed training examples (ids and decoded text) and exit")
    parser.add_argument("--ids", action="store_true",
                        help="with --preview: print only the ids, one JSON line per example")
    parser.add_argument("--keys", action="store_true",
                        help="list every key the YAML may hold: taken, accepted without effect, or refused, and why")
    parser.add_argument("--version", action="version", version=f"tiermem-train {__version__}")
    return parser


def print_keys() -> None:
    """``--keys``: every key with its type, default and meaning (the training YAML's by group, the tiermem
    config's by section), then every other known key and its answer."""
    from trainer.config_doc import keys_text

    for line in keys_text():
        print(line)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # (read at the first CUDA allocation)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.keys:
        try:
            print_keys()
        except BrokenPipeError:  # (piped into head): the rest is not wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.config is None:
        parser.error("the training YAML is required (tiermem-train CONFIG [key=value ...]; --keys lists the keys)")
    if args.ids and args.preview is None:
        parser.error("--ids goes with --preview N")
    from trainer.run.reached import Reached, Terminated

    reached, cfg = Reached(), None
    try:
        from tiermem.faults import install_from_env
        from trainer.config import load_train_config
        from trainer.preview import preview
        from trainer.run.loop import run

        install_from_env()
        cfg = load_train_config(args.config, args.overrides)
        if args.preview is None and os.environ.get("FORCE_TORCHRUN"):  # (the config checked once, here, first)
            from trainer.parallel.dist import relaunch
            from trainer.parallel.dp_checks import check_supported

            code = relaunch(sys.argv[1:] if argv is None else list(argv), lambda world: check_supported(cfg, world))
            if code is not None:
                return code
        if args.preview is not None:
            preview(cfg, args.preview, ids_only=args.ids)
        else:
            with terminated_raises(Terminated):
                run(cfg, reached=reached)
        return 0
    except KeyboardInterrupt:
        say_stopped("interrupted", reached, cfg, args, always=True)
        return 130
    except Terminated:
        say_stopped("terminated (SIGTERM)", reached, cfg, args, always=True)
        return 128 + signal.SIGTERM
    except Exception as e:
        err = _user_error(e)
        if err is None:
            traceback.print_exc()
            say_stopped("stopped", reached, cfg, args)
            return 1
        if err.quiet:  # (another rank of the run says it)
            return err.exit_code
        for line in err.lines():
            print(f"tiermem-train: error: {printable(err.rank_prefix + line)}", file=sys.stderr)
        if not _service_lost(err):  # (its line says how to go on: start the service again, rerun)
            say_stopped("stopped", reached, cfg, args)
        return err.exit_code


def _service_lost(err: UserError) -> bool:
    """The run's service went away (its state with it, maybe): the error's own line says how to continue."""
    if "tiermem.service.client" not in sys.modules:  # (never attached: it cannot have lost a service)
        return False
    from tiermem.service.client import ServiceLost

    return isinstance(err, ServiceLost)


def say_stopped(how: str, reached, cfg, args, always: bool = False) -> None:
    """The line of a run that stopped before its end: the step reached, the newest checkpoint, the command that
    continues (an error before training began says nothing more; Ctrl-C and SIGTERM say at least ``how``)."""
    from trainer.run.reached import stop_line

    if cfg is None or not reached.lead or (reached.step is None and not always):
        if always:
            print(f"tiermem-train: {how}", file=sys.stderr)
        return
    print(f"tiermem-train: {printable(stop_line(how, reached, cfg, args.config, args.overrides))}", file=sys.stderr)


@contextlib.contextmanager
def terminated_raises(exc: type[BaseException]):
    """SIGTERM raises ``exc`` in the main thread while the run goes on (the run then stops as on Ctrl-C); the
    handler before is put back after. Several ranks install their own when they join (``trainer.parallel.dist``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_it(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (once: a second one must not cut the stop's own cleanup)
        raise exc()

    before = signal.signal(signal.SIGTERM, raise_it)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)

if __name__ == "__main__":
    sys.exit(main())
