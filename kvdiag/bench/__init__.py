"""Tools that measure kvdiag itself: ``scale`` (``kvdiag bench scale``: every stage as traces grow) and
``gpu_check`` (``make gpu-check``: the whole package on a CUDA machine, one results file). Each stage's own bench
lives in its package (``kvdiag.label.bench``, ...); the ``kvdiag bench`` commands are in ``kvdiag.cli``."""
