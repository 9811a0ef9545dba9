"""``tiermem-train CONFIG [key=value ...]``: train a model as a LLaMA-Factory-style YAML describes.

A user mistake (bad config, missing file, bad data row, placement over budget) prints one line and
exits with code 2; nothing is written to output_dir.
"""

from __future__ import annotations

import argparse
import os
import sys

from tiermem.errors import UserError


def _user_error(e: BaseException) -> UserError | None:
    while e is not None:
        if isinstance(e, UserError):
            return e
        e = e.__cause__ or e.__context__
    return None


# PyTorch's caching allocator with expandable segments: a step's activations come and go beside a GPU tier
# that fills most of HBM, and fixed-size segments fragment it (set the variable yourself to choose otherwise)
ALLOC_CONF = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # (read at the first CUDA allocation)
    parser = argparse.ArgumentParser(prog="tiermem-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="training YAML (LLaMA-Factory keys)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. learning_rate=2e-5")
    parser.add_argument("--preview", type=int, metavar="N",
                        help="print the first N processed training examples as JSON lines and exit")
    args = parser.parse_args(argv)
    try:
        from tiermem.faults import install_from_env
        from trainer.config import load_train_config
        from trainer.loop import preview, run

        install_from_env()
        cfg = load_train_config(args.config, args.overrides)
        if args.preview is not None:
            preview(cfg, args.preview)
        else:
            run(cfg)
        return 0
    except KeyboardInterrupt:
        print("tiermem-train: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        err = _user_error(e)
        if err is None:
            raise
        print(f"tiermem-train: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
