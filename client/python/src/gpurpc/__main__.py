"""``python -m gpurpc``: the ``gpurpc`` command line (gpurpc.cli)."""
import sys

from .cli import main

sys.exit(main())
