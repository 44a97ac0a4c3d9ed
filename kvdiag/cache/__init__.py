"""The one KV cache with positions, shared by the Trace recorder (``kvdiag.trace``), replay and ``model.generate``
(``kvdiag.generate``): a floor-0 package so that every stage can build on it.

Flat API::

    from kvdiag.cache import (PositionedCache, PositionedLayer, QueryWindow, distinct_rows, position_mask,
                              use_kvdiag_attention)

Modules: ``positioned`` (the cache layers with positions, compacted in place), ``attend`` (the attention function a
positioned cache runs under: query window, masks from positions), ``blocks`` (rows written into blocks allocated
once: preallocated layers and the recorder's rows).
"""

from kvdiag.cache.attend import HANDOFF, QueryWindow, observing, position_mask, take_handoff, use_kvdiag_attention
from kvdiag.cache.blocks import append_rows
from kvdiag.cache.positioned import PositionedCache, PositionedLayer, distinct_rows

__all__ = [
    "HANDOFF", "PositionedCache", "PositionedLayer", "QueryWindow", "append_rows", "distinct_rows", "observing",
    "position_mask", "take_handoff", "use_kvdiag_attention",
]
