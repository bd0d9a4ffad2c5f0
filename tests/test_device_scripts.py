"""The device scripts (scripts/device_*.sh) parse as bash, and every `python3 -m verify` command in them uses only
flags that mla-verify has: they run only on the device, so a renamed flag would otherwise surface there, as a usage
error (exit 2) that costs a device call."""

import re
import subprocess
from pathlib import Path

import pytest

from verify import cli

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("device_*.sh"))
ENV = Path(__file__).resolve().parents[1] / "scripts" / "device_env.sh"  # sourced by the others: its wrappers too
VERIFY_FLAGS = {s for a in cli.build_parser()._actions for s in a.option_strings}


def verify_commands(text: str) -> list[str]:
    """Each `python3 -m verify ...` command of a script, its continuation lines joined, up to its redirections; and
    the arguments of each call of a shell function that passes its own ("$@") to such a command."""
    joined = text.replace("\\\n", " ")
    commands = [re.split(r"\s(?:2>&1|>|\|)", m.group(1))[0] for m in re.finditer(r"python3 -m verify (.*)", joined)]
    # a function whose body starts on the next line (one-line functions, `f() { ...; }`, have no `}` line)
    for name, body in re.findall(r"^(\w+)\(\)\s*\{[ \t]*(?:#[^\n]*)?\n(.*?)^\}", joined, re.M | re.S):
        if "python3 -m verify" in body and '"$@"' in body:
            commands += [m.group(1) for m in re.finditer(rf"^\s*{name} (.*?)\s*&?\s*$", joined, re.M)]
    return [" ".join(c.split()) for c in commands]


def flags(command: str) -> set[str]:
    """The long options of a command line."""
    return set(re.findall(r"(?<!\S)--[a-z][a-z0-9-]*", command))


def test_the_shared_campaign_wrappers_calls_are_checked():
    """device_env.sh's pool_campaign runs the device scripts' campaigns: their arguments are checked with it."""
    text = ENV.read_text() + (ENV.parent / "device_step_check.sh").read_text()
    calls = [c for c in verify_commands(text) if c.startswith("s_")]
    assert calls and all("--dtype" in c for c in calls), calls


def test_there_are_device_scripts_that_run_mla_verify():
    assert len(SCRIPTS) >= 5
    assert sum(len(verify_commands(p.read_text())) for p in SCRIPTS) >= 4


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_script_parses_and_uses_known_verify_flags(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    if script != ENV and "device_env.sh" in text:  # calls of device_env.sh's wrappers, with their definitions
        text = ENV.read_text() + text
    for command in verify_commands(text):
        unknown = flags(command) - VERIFY_FLAGS
        assert not unknown, f"{script.name}: {command!r} uses {sorted(unknown)}"


def test_a_wrapper_functions_arguments_are_checked_too():
    script = 'campaign() {\n  python3 -m verify --json x "$@" > log\n}\ncampaign a --dtype fp8 --hedas 2 &\n'
    assert verify_commands(script) == ['--json x "$@"', "a --dtype fp8 --hedas 2"]


def test_an_unknown_flag_is_caught():
    command = verify_commands('timeout 9 python3 -m verify --backend triton --time-limt 5 \\\n  --json x 2>&1 | tail')
    assert command == ["--backend triton --time-limt 5 --json x"]
    assert flags(command[0]) - VERIFY_FLAGS == {"--time-limt"}


def test_failures_reach_mla_test_failures_as_they_happen(tmp_path):
    """tests/conftest.py appends each failure's traceback to $MLA_TEST_FAILURES while the run goes on (the device
    scripts' runs may be killed at a time limit, before pytest's failures section): a real pytest run of one passing
    and one failing test writes the failing one's node id and assertion, and nothing of the passing one."""
    import os
    import sys

    (tmp_path / "test_two.py").write_text("def test_passes():\n    assert 1\n\n\n"
                                          "def test_fails():\n    assert 2 + 2 == 5, 'arithmetic'\n")
    log = tmp_path / "failures.txt"
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, MLA_TEST_FAILURES=str(log), PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent)]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                          "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_two.py")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    text = log.read_text()
    assert "test_two.py::test_fails (call)" in text and "arithmetic" in text and "test_passes" not in text, text
