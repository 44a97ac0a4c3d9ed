"""The CLI's options: every flag several commands take has one definition (``kvdiag.cli.common.FLAGS``), and every
command's ``--help`` groups its options in panels, with no ``<bool>`` placeholder on a flag."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

from click.testing import CliRunner

from kvdiag.cli import common
from kvdiag.cli.main import root_command

CLI = Path(__file__).resolve().parents[1] / "kvdiag" / "cli"


def declared_flags() -> dict[str, list[str]]:
    """Each flag declared with ``typer.Option`` in ``kvdiag/cli/`` -> the files that declare it."""
    where = collections.defaultdict(list)
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Option" and \
                    getattr(node.func.value, "id", "") == "typer":
                names = [a.value for a in node.args[1:] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if names:
                    where[names[0].split("/")[0]].append(path.name)
    return where


def test_a_flag_several_commands_take_is_declared_once():
    where = declared_flags()
    assert {"--harm", "--quiet"} <= set(where)  # the check sees the declarations
    repeated = {name: files for name, files in where.items() if len(files) > 1}
    assert repeated == {}, "declare these once in kvdiag.cli.common.FLAGS and make them with common.flag()"
    # and no flag of FLAGS is declared by hand beside it
    assert not (set(where) - {"--model", "--dtype", "--prompts", "--limit"}) & set(common.FLAGS)


def commands(command, names=()):
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*names, name))
    if not hasattr(command, "commands"):
        yield names, command


def test_every_option_is_in_a_panel_and_flags_show_no_placeholder():
    root = root_command()
    seen = 0
    panels = {common.INPUTS, common.WHAT, common.OUTPUTS, common.PERFORMANCE, *common.MODES}
    for names, command in commands(root):
        options = [p for p in command.params if p.param_type_name == "option"]
        assert all(p.rich_help_panel in panels for p in options), (names, [p.name for p in options])
        text = CliRunner().invoke(root, [*names, "--help"], terminal_width=200).output
        assert "<bool>" not in text, names
        seen += 1
    assert seen >= 20
    replay = CliRunner().invoke(root, ["replay", "--help"], terminal_width=200).output
    assert "─ Free-running ─" in replay and "─ Teacher-forced ─" in replay and "─ Inputs ─" in replay


def test_every_numeric_option_is_bounded():
    """#55: each option that takes one number has its range in ``common.BOUNDS`` (checked on the command line for
    ASCII digits and the range, before click converts it), and the check refuses what it should."""
    import pytest

    from kvdiag.core.errors import UserError

    numeric = {p.opts[0] for _, command in commands(root_command()) for p in command.params
               if p.param_type_name == "option" and common.numeric(p) is not None}
    assert {"--seed", "--bootstrap", "--batch-size"} <= numeric
    assert sorted(numeric - set(common.BOUNDS)) == []
    common.check_number("--seed", "7", int)
    common.check_number("--top-p", "0.9", float)
    for flag, text, kind in [("--seed", str(2**64), int), ("--seed", "\u0663", int), ("--seed", "1.5", int),
                             ("--top-p", "nan", float), ("--search-seconds", "inf", float), ("--top-p", "2", float)]:
        with pytest.raises(UserError, match=flag):
            common.check_number(flag, text, kind)


def test_every_demo_option_reaches_its_stages(tmp_path):
    """#58: the demo's options reach every stage that takes them (--bootstrap did not reach figures)."""
    from kvdiag.cli.demo import demo_commands

    stages = {name: argv for name, _, argv in demo_commands(tmp_path, "tiny:llama", "builtin:arith", 2, 64, 16, 8,
                                                            32, 123)}
    for name in ("rank-eval", "figures"):
        i = stages[name].index("--bootstrap")
        assert stages[name][i + 1] == "123", name
    assert stages["label"][stages["label"].index("--horizon") + 1] == "8"
