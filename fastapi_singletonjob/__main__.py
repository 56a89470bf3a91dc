"""``python -m fastapi_singletonjob``: the ``singletonjob`` command (see ``_cli``)."""

import sys

from ._cli import main

sys.exit(main())
