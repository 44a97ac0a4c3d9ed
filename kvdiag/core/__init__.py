"""The shared floor: what every stage stands on, none of it a stage.

Errors and the one-line refusal (``errors``), checked readers of every input file (``contracts``), Parquet tables
with provenance (``io``, ``provenance``, ``parts``: the resumable part store), the output guard (``guard``), the
parsers of command-line values (``parsing``), the columns every stage agrees on (``schema``), which labels are
harmful (``harm``), which entries a rule keeps (``selection``), statistics (``stats``), Markdown tables and figures
(``tables``, ``plotting``), registries by name (``registry``), progress, lazy exports (``lazy``), work splitting
(``distributed``), the run directory's layout (``run_layout``) and the allocator setting (``allocator``).
Imports nothing above it.
"""
