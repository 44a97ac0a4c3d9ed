"""``python -m kvdiag`` (used by ``torchrun -m kvdiag``)."""

from cli.main import main

main()
