"""A run directory shown to a reader: ``run`` (``report_files``: report.md and a self-contained report.html) and
``viewer`` (``build_viewer``: the token-by-token page, with its static files in ``viewer_static/``)."""
