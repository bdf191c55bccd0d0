"""``python -m shardserver ...``: the ``shardserver`` command line (:func:`shardserver.cli.main`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
