"""kvdiag: counterfactual oracle labels and diagnostics for KV-cache eviction in long chain-of-thought.

Layout, bottom up (each a package; a package imports only those below it, tests/test_layout.py):
``core`` (the shared floor), ``model``, ``kernels`` and ``cache`` (the model layer), ``tasks`` (prompts and suites),
the stages in pipeline order (``trace``, ``label``, ``scorers``, ``rankeval``, ``fit``, ``figures``, ``generate``,
``decisions``, ``replay``), the tools (``grade``, ``report``, ``bench``) and the CLI (``cli``) on top.
"""

from kvdiag.core import moved

__version__ = "0.1.0"

moved.install()  # the old module paths of the loose modules (deprecated)
