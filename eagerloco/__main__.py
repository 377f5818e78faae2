"""``python -m eagerloco`` and the ``eagerloco`` command, with Ctrl-C at any moment of the start-up ending in one line.

The console script's target is :func:`run`, here, so that its own import is this small module alone and
everything after it, ``eagerloco.cli`` included, runs inside the handler.
"""

import os
import sys


def run() -> None:
    """Run the command and exit with its status."""
    try:
        from eagerloco.cli import is_launched_training, main

        code = main()
    except KeyboardInterrupt:  # before a command installed its own handler (a run prints its own line)
        print("eagerloco: stopped by SIGINT before the command started", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # os._exit, not sys.exit: a Ctrl-C that lands while torch's import runs Python code from C++ (pybind11's
        # exec) leaves CPython's "unhandled KeyboardInterrupt" flag set although the interrupt was handled here,
        # and the interpreter would then kill itself with SIGINT at exit instead of returning 130. Nothing has
        # started that needs a clean shutdown.
        os._exit(130)
    if is_launched_training():
        # A rank of a launched run (eagerloco launch, torchrun) whose command returned: its files are written and
        # closed and its process groups destroyed. It ends without the interpreter's teardown, in which a thread
        # still inside torch's C++ (its GIL released) is ended by CPython with pthread_exit and aborts the process
        # ("terminate called without an active exception", status 134) after a run that succeeded: seen on a
        # non-reporting rank in about 1 of 2 full test runs on a busy 2-core machine.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
