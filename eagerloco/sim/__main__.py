"""``python -m eagerloco.sim``: the simulate subcommand on its own."""

import sys

from eagerloco.cli import main

sys.exit(main(["simulate", *sys.argv[1:]]))
