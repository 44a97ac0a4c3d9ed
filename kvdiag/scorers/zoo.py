"""Every built-in rule, imported once (each module registers its scorer on import). The registry imports this module
before it hands out a name, then lists the built-ins in ``kvdiag.scorers.names.BUILTIN_SCORERS`` order (the columns
of ``--scorers all``), whichever rule module was imported first."""

from kvdiag.scorers import (  # noqa: F401  (imported to register)
    attention,
    attention_x_age,
    avokv_e,
    avokv_e_ablations,
    cake,
    fitted,  # not in --scorers all: needs --param fitted.path=model.json
    h2o,
    knorm,
    kvpress_press,  # the kvpress: resolver; kvpress itself loads on first use
    lazyeviction,
    longflow,
    obcache,
    random_scorer,
    rkv,
    snapkv,
    streamingllm,
    thinkv,
    tova,
    value_norm,
    vase,
    vatp,
)
from kvdiag.scorers.names import BUILTIN_SCORERS
from kvdiag.scorers.registry import SCORERS

SCORERS.reorder(BUILTIN_SCORERS)
