"""The error catalog (``phalanx explain``) and the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import catalog, cli, errors
from phalanx.catalog import CATALOG, explain, list_codes

SECTIONS = ["What it means", "When it happens", "Common causes", "What to do", "Example fix"]
TRAINING_FAILED_KINDS = ["PX201", "PX202", "PX203", "PX204", "PX205", "PX206"]
SRC = Path(__file__).resolve().parents[1] / "src"


def test_catalog_covers_every_error_class_and_training_failed_kind() -> None:
    codes = {cls.code for cls in errors.all_error_classes()}
    assert {"PX100", "PX113", "PX120", "PX200"} <= codes
    missing = (codes | set(TRAINING_FAILED_KINDS)) - set(CATALOG)
    assert not missing, f"no catalog entry for {sorted(missing)}"


def test_every_entry_is_complete_and_keyed_by_its_code() -> None:
    for code, e in CATALOG.items():
        assert re.fullmatch(r"PX\d{3}", code) and e.code == code
        assert e.title and len(e.meaning) > 40 and len(e.when) > 20, code
        assert e.causes and all(c.strip() for c in e.causes), code
        assert e.fixes and all(f.strip() for f in e.fixes), code
        assert e.example.strip(), code


def test_entries_name_the_specific_fix() -> None:
    assert "GLOBAL" in CATALOG["PX113"].meaning
    assert any("number of devices" in f for f in CATALOG["PX113"].fixes)
    assert "__main__" in CATALOG["PX116"].example
    assert "functools.partial" in CATALOG["PX114"].example
    assert "hang_timeout" in CATALOG["PX202"].meaning
    assert any("collective" in c for c in CATALOG["PX202"].causes)
    assert any("grad_accumulation" in f for f in CATALOG["PX203"].fixes)
    assert any("dmesg" in f for f in CATALOG["PX201"].fixes)
    assert any("OOM killer" in c for c in CATALOG["PX201"].causes)
    assert "first failure is the root cause" in CATALOG["PX204"].meaning
    assert any("sample indices" in f for f in CATALOG["PX204"].fixes)
    assert "NaN" in CATALOG["PX107"].title


def test_explain_has_all_sections_in_order_and_accepts_lowercase() -> None:
    text = explain("px113")
    assert text.startswith("PX113: global batch smaller than the number of workers")
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    assert "1. Raise batch_size" in text
    assert "batch_size=256" in text
    assert explain(" PX113 ") == text == explain("113")


def test_explain_unknown_code_lists_close_matches() -> None:
    with pytest.raises(KeyError) as info:
        explain("PX1133")
    message = info.value.args[0]
    assert "unknown error code 'PX1133'" in message
    assert "PX113" in message
    assert "phalanx explain" in message


def test_list_codes_one_line_per_code() -> None:
    lines = list_codes().splitlines()
    assert len(lines) == len(CATALOG)
    assert "PX203  a worker ran out of memory" in lines
    assert [line.split()[0] for line in lines] == sorted(CATALOG)


def test_cli_explain_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "PX113"]) == 0
    out = capsys.readouterr().out
    assert "global batch smaller than the number of workers" in out
    for section in SECTIONS:
        assert section in out


def test_cli_explain_without_code_lists_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain"]) == 0
    out = capsys.readouterr().out
    assert "PX116  missing if __name__ == '__main__': guard" in out
    assert "PX202  a worker hung" in out


def test_cli_explain_unknown_code_fails_helpfully(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "PX999"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown error code 'PX999'" in captured.err
    assert "phalanx explain" in captured.err


@pytest.mark.parametrize("argv", [["--help"], ["explain", "--help"], ["demo", "--help"]])
def test_cli_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: phalanx")
    if argv[0] == "demo":
        for flag in ("--epochs", "--batch-size", "--devices", "--strategy", "--run-dir"):
            assert flag in out
        assert "--resume" in out and "--fault" in out and "--seed" in out
        _the_fault_grammar_is_whole_and_its_examples_parse(out)


def _the_fault_grammar_is_whole_and_its_examples_parse(out: str) -> None:
    from phalanx.faults import KINDS, Fault

    assert "KIND:WORKER@STEP[/PHASE][xTIMES]" in out
    for kind in KINDS:
        assert re.search(rf"^\s+(KIND\s+)?{kind}\s", out, re.M), kind
    for phase in ("preflight", "data", "forward", "backward", "sync", "optimizer", "metrics"):
        assert phase in out
        Fault.parse(f"exception:0@1/{phase}")  # each phase listed is one that can be injected
    examples = re.findall(r"--fault ([a-z]+:\d+@\S+)", out)
    assert len(examples) >= 3
    for text in examples:
        Fault.parse(text)


def test_cli_version_and_documented_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    from phalanx import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"phalanx {__version__}"
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for code in ("0 ", "1 ", "2 ", "130", "141", "143"):
        assert re.search(rf"^  {code}", out, re.M), code


@pytest.mark.parametrize("argv", [["report", "--help"], ["plot", "--help"]])
def test_cli_report_and_plot_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 0
    assert "RUN_DIR" in capsys.readouterr().out


def test_cli_report_and_plot_of_an_empty_folder_fail_helpfully(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["report", str(tmp_path)]) == 1
    assert "no run in" in capsys.readouterr().out
    assert cli.main(["plot", str(tmp_path)]) == 1
    assert "no committed steps" in capsys.readouterr().err


def test_demo_strategy_is_one_of_the_three(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--strategy", "thread"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'thread'" in err and "threads" in err


@pytest.mark.parametrize("reader", ["head -2", "true"])
def test_explain_into_a_closed_pipe_is_quiet(reader: str) -> None:
    """``true`` exits before phalanx writes: the write meets a closed pipe for sure."""
    result = subprocess.run(
        f"{sys.executable} -m phalanx explain | {reader}; echo status ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=60,
    )
    *shown, status = result.stdout.splitlines()
    assert result.stderr == ""
    if reader == "true":
        assert shown == [] and status == "status 141"
    else:
        assert shown == list_codes().splitlines()[:2]


def test_cli_without_command_prints_help_and_returns_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert "explain" in out and "demo" in out


def test_cli_usage_error_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--epochs", "many"]) == 2
    assert "invalid int value" in capsys.readouterr().err


def test_demo_parser_defaults_and_repeatable_fault() -> None:
    args = cli.build_parser().parse_args(["demo", "--fault", "kill:1@30", "--fault", "hang:0@5"])
    assert args.fault == ["kill:1@30", "hang:0@5"]
    assert (args.epochs, args.batch_size, args.devices, args.strategy) == (8, 64, "cpu", "single")
    assert (args.run_dir, args.resume, args.seed) == ("runs/demo", False, 0)
    assert args.handler is cli._demo


def test_demo_dispatches_to_run_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    seen: list[object] = []

    def run_demo(args: object) -> int:
        seen.append(args)
        return 7

    fake = types.ModuleType("phalanx.demo")
    fake.run_demo = run_demo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "phalanx.demo", fake)
    assert cli.main(["demo", "--epochs", "2", "--resume"]) == 7
    (args,) = seen
    assert args.epochs == 2 and args.resume is True and args.fault == []  # type: ignore[attr-defined]


def test_python_dash_m_phalanx_explain() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "phalanx", "explain", "px204"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("PX204: poison batch")
    assert catalog.CATALOG["PX204"].title in result.stdout


def test_cli_demo_without_scikit_learn_names_the_install_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in [n for n in sys.modules if n == "sklearn" or n.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # any import of it now fails
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--run-dir", str(tmp_path / "run"), "--epochs", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert "scikit-learn" in captured.err
    assert "pip install 'phalanx[demo]'" in captured.err
    assert "demo" in extras_in_pyproject()  # the extra the message names exists
    assert list(tmp_path.iterdir()) == []


def extras_in_pyproject() -> list[str]:
    text = (SRC.parent / "pyproject.toml").read_text()
    block = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return re.findall(r"^(\w+) = ", block, flags=re.M)


@pytest.mark.parametrize(
    ("code", "words"),
    [
        ("PX140", ["PHALANX_NODE_RANK=2", "phalanx run"]),
        ("PX141", ["--nproc-per-node 1", "--ntasks-per-node 1", "devices="]),
        ("PX142", ["one node only", "strategy='ddp'", "docs/multinode.md"]),
        ("PX144", ["fingerprint", "PHALANX_HEAD"]),
        ("PX151", ["PHALANX_TOKEN", "0600"]),
        ("PX150", ["ignored", "the run went on", "private network", "address"]),
        ("PX143", ["phalanx.lock", "another run_dir"]),
    ],
)
def test_the_launch_codes_are_explained(
    code: str, words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["explain", code.lower()]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{code}: {CATALOG[code].title}")
    flat = " ".join(out.split())
    for word in words:
        assert word in flat, (code, word)


# `phalanx run`: sets PHALANX_* and becomes the script, its arguments passed as they are.
ECHO = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items()
                  if k.startswith("PHALANX_")}}))
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


def _phalanx_run(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    base = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "run", *[a.replace("ECHO", str(script)) for a in argv]],
        capture_output=True,
        text=True,
        env={**base, "PYTHONPATH": str(SRC), **env},
        timeout=60,
    )


def test_phalanx_run_sets_the_variables_and_passes_the_arguments(tmp_path: Path) -> None:
    head = ("--head", "node0:29410")
    proc = _phalanx_run(tmp_path, "--nnodes", "3", "--node-rank", "2", *head, "ECHO",
                        "--lr", "3", "--", "-x", EXIT_WITH="5")  # fmt: skip
    assert proc.returncode == 5, proc.stderr  # the script's own status
    seen = json.loads(proc.stdout)
    assert seen["argv"] == ["--lr", "3", "--", "-x"]
    assert seen["env"] == {
        "PHALANX_NNODES": "3",
        "PHALANX_NODE_RANK": "2",
        "PHALANX_HEAD": "node0:29410",
    }


def test_phalanx_run_starts_a_spare(tmp_path: Path) -> None:
    proc = _phalanx_run(tmp_path, "--nnodes", "2", "--node-rank", "spare", "--head", "n0:1",
                        "ECHO")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["env"]["PHALANX_NODE_RANK"] == "spare"


def test_phalanx_run_on_one_node_drops_a_stale_head(tmp_path: Path) -> None:
    proc = _phalanx_run(tmp_path, "--nnodes=1", "--", "ECHO", PHALANX_HEAD="old:1")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["env"] == {"PHALANX_NNODES": "1", "PHALANX_NODE_RANK": "0"}
    assert seen["argv"] == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "0", "ECHO"], "--nnodes 0: pass the number of nodes"),
        (["--nnodes", "2", "--head", "h:1", "ECHO"], "--nnodes 2 needs --node-rank"),
        (["--nnodes", "2", "--node-rank", "2", "--head", "h:1", "ECHO"], "pass 0 (the head) to 1"),
        (["--nnodes", "2", "--node-rank", "1", "ECHO"], "--nnodes 2 needs --head HOST:PORT"),
        (["--nnodes", "1", "--node-rank", "spare", "ECHO"], "a spare stands in for a node"),
        (["--nnodes", "2", "--node-rank", "spare", "ECHO"], "--nnodes 2 needs --head HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "1", "--head", "h", "ECHO"], "[PX140]"),
        (["--nnodes", "1", "--head", "h:99999", "ECHO"], "port 99999 is not 1 to 65535"),
        (["--nnodes", "1", "missing.py"], "no such script: missing.py"),
    ],
)
def test_phalanx_run_refuses_bad_arguments_and_starts_nothing(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "echo.py").write_text("raise SystemExit('started')")
    argv = [a.replace("ECHO", str(tmp_path / "echo.py")) for a in argv]
    assert cli.main(["run", *argv]) == 2  # in-process: an exec would replace pytest
    captured = capsys.readouterr()
    assert captured.err.startswith("phalanx run: ") and message in captured.err
    assert captured.out == ""


def test_phalanx_run_needs_nnodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "train.py"]) == 2
    assert "--nnodes" in capsys.readouterr().err
