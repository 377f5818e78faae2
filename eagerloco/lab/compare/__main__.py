"""``python -m eagerloco.compare``: the compare command alone."""

from eagerloco.compare.cli import main

raise SystemExit(main())
