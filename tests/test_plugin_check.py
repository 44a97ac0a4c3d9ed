"""kvdiag.scorers.plugin_check refuses only what a plugin's source decides: the files that are fine, or whose fault
needs
them to run, pass (and the registry's import then decides)."""

from __future__ import annotations

import pytest

from kvdiag.core.errors import UserError
from kvdiag.scorers.plugin_check import check_plugin_files

HEAD = "from dataclasses import dataclass\nfrom kvdiag.scorers import Scorer, register_scorer\n\n\n"
PASSES = {
    "fine": HEAD + "@register_scorer('mine')\n@dataclass\nclass Mine(Scorer):\n    def score(self, ctx):\n"
                   "        return ctx.keys.norm(dim=-1)\n",
    # sys.path may be changed before a later import: only the leading run of imports is checked
    "path_first": "import sys\nsys.path.insert(0, '/somewhere')\nimport no_such_module_kvdiag\n",
    "guarded": "try:\n    import no_such_module_kvdiag\nexcept ImportError:\n    pass\n",
    # score() may come from a base class other than Scorer
    "inherits": HEAD + "from kvdiag.scorers import KNorm\n\n@register_scorer('mine')\n@dataclass\n"
                       "class Mine(KNorm):\n    pass\n",
    # an exit that does not run at import: under the main guard, in a function, in a class body's method
    "main_guard": "import sys\n\ndef main():\n    sys.exit(1)\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "exit_attr": "class A:\n    def stop(self):\n        raise SystemExit(2)\n",
    # a raise that may not run at import: under a condition, or re-raising in a handler
    "conditional_raise": "import sys\nif sys.version_info < (3, 0):\n    raise ImportError('needs Python 3')\n",
    "reraise": "try:\n    import json\nexcept ImportError:\n    raise\n",
    "computed_name": HEAD + "NAME = 'knorm'\n@register_scorer(NAME)\n@dataclass\nclass Mine(Scorer):\n"
                            "    def score(self, ctx):\n        return ctx.keys.norm(dim=-1)\n",
}
REFUSED = {
    "sys_exit": ("import sys\nsys.exit(0)\n", "exits at import (sys.exit() at"),
    "exit_in_try": ("import os\ntry:\n    x = 1\nexcept Exception:\n    pass\nelse:\n    os._exit(3)\n",
                    "exit_in_try.py:7"),
    "raise_system_exit": ("if True:\n    raise SystemExit('bye')\n", "raise SystemExit at"),
    "quit": ("quit()\n", "quit() at"),
    "interrupt_in_with": ("import contextlib\nwith contextlib.nullcontext():\n    raise KeyboardInterrupt\n",
                          "raise KeyboardInterrupt at"),
    # a raise of anything in the module body runs at every import
    "top_raise": ("import os\nraise RuntimeError('not ready')\n", "raises at import (raise RuntimeError('not "
                  "ready') at"),
    "bare_raise": ("x = 1\nraise\n", "(raise at"),
    "bare_taken": (HEAD + "@register_scorer\n@dataclass\nclass KNorm(Scorer):\n    def score(self, ctx):\n"
                          "        return ctx.keys\n", "'knorm' is taken by the built-in"),
    "named_taken": (HEAD + "@register_scorer\n@dataclass\nclass Mine(Scorer):\n    name = 'tova'\n"
                           "    def score(self, ctx):\n        return ctx.keys\n", "'tova' is taken by the built-in"),
    "from_import": ("from no_such_module_kvdiag.x import y\n", "from_import.py:1"),
    "aliased": ("from kvdiag.scorers import Scorer as S, register_scorer\n\n@register_scorer('a')\nclass A(S):\n"
                "    pass\n", "aliased.py:3) defines no score"),
}


@pytest.mark.parametrize("name", PASSES)
def test_passes(name, tmp_path):
    path = tmp_path / f"{name}.py"
    path.write_text(PASSES[name])
    check_plugin_files([str(path)])


@pytest.mark.parametrize("name", REFUSED)
def test_refused(name, tmp_path):
    source, needle = REFUSED[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    with pytest.raises(UserError) as exc:
        check_plugin_files([str(path)])
    assert needle in str(exc.value) and str(exc.value).startswith(f"--plugin {path}: ")
