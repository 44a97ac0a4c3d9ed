"""Bad input: one line naming the input and the fix, exit code 2, nothing written half-way."""

from __future__ import annotations

import pytest

from kvdiag.cli.main import main


def run(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr().err


def test_bad_json_line_is_named(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"problem": "1+1?"}\n{oops\n')
    code, err = run(["trace", "--model", "tiny:llama", "--prompts", str(bad), "--out", str(tmp_path / "t")], capsys)
    assert code == 2 and "line 2" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "/no/such.gguf"], "GGUF file not found"), (["--model", "tiny:gpt9"], "unknown tiny architecture"),
        (["--max-new-tokens", "0"], "--max-new-tokens"), (["--prompts", "/no/such.jsonl"], "file not found"),
        (["--prompts", "builtin:nope"], "unknown builtin"),
    ],
)
def test_bad_inputs_exit_2(args, needle, tmp_path, capsys):
    model = [] if "--model" in args else ["--model", "tiny:llama"]  # an option given twice is refused
    code, err = run(["trace", *model, "--out", str(tmp_path / "t"), *args], capsys)
    assert code == 2 and needle in err
    assert not (tmp_path / "t" / "manifest.json").exists()


def test_out_dir_of_another_model_is_refused(tmp_path, capsys):
    out = str(tmp_path / "t")
    main_args = ["trace", "--out", out, "--max-new-tokens", "3", "--limit", "1", "--quiet", "--no-chat"]
    with pytest.raises(SystemExit) as exc:
        main([*main_args, "--model", "tiny:llama"])
    assert exc.value.code == 0
    code, err = run([*main_args, "--model", "tiny:qwen3"], capsys)
    assert code == 2 and "holds a Trace of another model" in err
