"""``python -m phalanx``: the ``phalanx`` command.

The guard matters: spawned ddp workers re-import the main module as ``__mp_main__``.
"""

import sys

from phalanx.cli import main

if __name__ == "__main__":
    sys.exit(main())
