"""``python -m eagerloco``: the command line, with Ctrl-C during start-up (importing torch) ending in one line."""

import sys

try:
    from eagerloco.cli import main

    code = main()
except KeyboardInterrupt:  # before a command installed its own handler (a run prints its own line)
    print("eagerloco: stopped by SIGINT before the command started", file=sys.stderr, flush=True)
    code = 130
sys.exit(code)
