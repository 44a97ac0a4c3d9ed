"""``python -m kvdiag`` (used by ``torchrun -m kvdiag``)."""

from kvdiag.cli.main import main

main()
