"""The `lowcomm-node` command's entry point (pyproject.toml [project.scripts]).

It imports the CLI inside ``main``: a Ctrl-C while Python imports it (torch and hivemind, the
first moments after the command starts) then ends the program quietly with 130, as one a moment
later does (cli.main), instead of a KeyboardInterrupt traceback from the import."""

from __future__ import annotations

import sys
from typing import Sequence

EXIT_INTERRUPTED = 130  # the shell's code for a program ended by SIGINT


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
