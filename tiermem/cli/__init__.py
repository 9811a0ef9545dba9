"""The ``tiermem`` command: ``main`` (the commands and their arguments), ``top`` (the live view and the
stats formats) and ``probe`` (the machine's links measured)."""

from tiermem.cli.main import main

__all__ = ["main"]
