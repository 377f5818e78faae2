import sys

from eagerloco.cli import main

sys.exit(main())
