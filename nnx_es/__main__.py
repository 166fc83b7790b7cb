"""``python -m nnx_es <command>``: the ``nnx-es`` command (:mod:`nnx_es.cli.main`)."""

import sys

from nnx_es.cli.main import main

sys.exit(main())
