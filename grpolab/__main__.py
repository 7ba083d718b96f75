"""``python -m grpolab`` (and ``torchrun --nproc_per_node N -m grpolab train ...``): the ``grpolab`` command."""

import sys

from grpolab.commands.cli import main

sys.exit(main())
