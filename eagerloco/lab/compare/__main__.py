"""``python -m eagerloco.lab.compare``: the compare command alone."""

from eagerloco.lab.compare.cli import main

raise SystemExit(main())
