"""How the recall run's fixed length grades: Gemma 3 270M (base) writes no EOS, so each generation runs to
``--max-new-tokens`` 140, the expected answer's exact length. A generation that closed its answer early (a blank
line: the separator of the prompt's shots) goes on with a made-up next shot, and its last line is then not the answer
line. This prints, per rule and budget, how many generations wrote a blank line, and the ``recalled`` verdicts of the
text as graded and cut at its first blank line (what an end-of-answer stop would have graded).

Usage: ``python reports/replay-gemma3/stops.py [reports/replay-gemma3/recall/generations.parquet]``.
"""

import sys

import polars as pl

from kvdiag.core.stats import wilson
from kvdiag.tasks.suites import grade, suite_of

SOURCE = "builtin:recall"


def main(argv: list[str] | None = None) -> None:
    """Print one line per (rule, budget): n, blank-line generations, recalled as graded and cut, with Wilson CIs."""
    args = argv if argv is not None else sys.argv[1:]
    path = args[0] if args else "reports/replay-gemma3/recall/generations.parquet"
    suite, gens = suite_of(SOURCE), pl.read_parquet(path)
    print("rule budget n blank_line recalled recalled_cut_at_blank_line")
    for (scorer, budget), rows in gens.group_by(["scorer", "budget"], maintain_order=True):
        n, blank, graded, cut = rows.height, 0, 0, 0
        for text, answer in zip(rows["text"], rows["answer"], strict=True):
            body = text.strip()
            blank += "\n\n" in body
            graded += grade(suite, text, answer)["recalled"]
            cut += grade(suite, body.split("\n\n", 1)[0], answer)["recalled"]
        cis = [wilson(k, n) for k in (graded, cut)]
        print(scorer, budget, n, blank, *(f"{k}/{n}[{100 * lo:.0f},{100 * hi:.0f}]"
                                          for k, (lo, hi) in zip((graded, cut), cis, strict=True)))


if __name__ == "__main__":
    main()
