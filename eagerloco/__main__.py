"""``python -m eagerloco``: the command line, with Ctrl-C during start-up (importing torch) ending in one line."""

import os
import sys

try:
    from eagerloco.cli import main

    code = main()
except KeyboardInterrupt:  # before a command installed its own handler (a run prints its own line)
    print("eagerloco: stopped by SIGINT before the command started", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # os._exit, not sys.exit: a Ctrl-C that lands while torch's import runs Python code from C++ (pybind11's
    # exec) leaves CPython's "unhandled KeyboardInterrupt" flag set although the interrupt was handled here, and
    # the interpreter would then kill itself with SIGINT at exit instead of returning 130. Nothing has started
    # that needs a clean shutdown.
    os._exit(130)
sys.exit(code)
