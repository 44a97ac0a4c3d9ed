"""One Markdown table writer: byte-identical to the three hand-written ones it replaced."""

from __future__ import annotations

from kvdiag.core.tables import markdown_table

HEAD = ["Score", "AUROC", "AP"]
ROWS = [["rkv", "0.817 [0.80, 0.83]", "0.4"], ["h2o", "n/a", "0.1"]]


def test_rank_eval_layout():  # rankeval/tables.py: "|---|" then "---:|" per metric
    old = "\n".join(["| Score | " + " | ".join(HEAD[1:]) + " |", "|---|" + "---:|" * 2,
                     *(f"| {r[0]} | " + " | ".join(r[1:]) + " |" for r in ROWS)]) + "\n"
    assert markdown_table(HEAD, ROWS) == old


def test_replay_layout():  # replay/figure.py: every column left-aligned
    old = (
        "\n".join(["| " + " | ".join(HEAD) + " |", "|" + "---|" * 3, *("| " + " | ".join(r) + " |" for r in ROWS)])
        + "\n"
    )
    assert markdown_table(HEAD, ROWS, "lll") == old


def test_report_layout():  # report.md_table: per-column alignment, cells through a formatter
    align, cell = "lrl", lambda v: str(v).replace("|", "\\|")
    rows = [["a|b", 1, None]]
    old = "\n".join(["| " + " | ".join(HEAD) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
                     *("| " + " | ".join(cell(v) for v in r) + " |" for r in rows)]) + "\n"
    assert markdown_table(HEAD, rows, align, cell) == old
    assert markdown_table(HEAD, rows, align, cell).splitlines()[2] == "| a\\|b | 1 | None |"
