"""``torchrepro completion SHELL``: shtab's script from the real parser, checked in a real bash
that sources it and completes a command and an option; without shtab, exit 2 naming the extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import torchrepro, user_env

pytest.importorskip("shtab")

# Completes the words of a command line as bash would on <TAB>: the completion function the script
# registered for `torchrepro`, called with COMP_WORDS/COMP_CWORD set; prints COMPREPLY, one a line.
DRIVER = r"""
source "$1"
line="$2"
read -ra COMP_WORDS <<< "$line"
[[ "$line" == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMP_LINE="$line"; COMP_POINT=${#line}
function=$(complete -p torchrepro | sed -E 's/.*-F ([^ ]+) .*/\1/')
"$function" torchrepro "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"
"""


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    proc = torchrepro(Path.cwd(), "completion", "bash")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path_factory.mktemp("completion") / "torchrepro.bash"
    path.write_text(proc.stdout)
    return path


def _complete(script: Path, line: str) -> list[str]:
    proc = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", DRIVER, "driver", str(script), line],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_the_bash_script_parses(bash_script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(bash_script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("torchrepro ch", ["check"]),
        ("torchrepro check --va", ["--vary"]),
        ("torchrepro check --vary ", ["workers", "threads", "hashseed", "world", "resume", "compile"]),
        ("torchrepro completion ", ["bash", "zsh", "tcsh"]),
    ],
)
def test_bash_completes_commands_options_and_choices(
    bash_script: Path, line: str, expected: list[str]
) -> None:
    assert _complete(bash_script, line) == expected


def test_a_negative_control_completes_nothing_unknown(bash_script: Path) -> None:
    assert _complete(bash_script, "torchrepro xyz") == []


@pytest.mark.parametrize("shell", ["zsh", "tcsh"])
def test_other_shells_get_a_script(shell: str) -> None:
    proc = torchrepro(Path.cwd(), "completion", shell)
    assert proc.returncode == 0, proc.stderr
    assert "torchrepro" in proc.stdout


def test_without_shtab_it_exits_2_naming_the_extra() -> None:
    code = (  # an import of shtab fails as if it were not installed
        "import sys; sys.modules['shtab'] = None; from torchrepro.cli import main; "
        "sys.exit(main(['completion', 'bash']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=user_env(), timeout=60
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "pip install torchrepro[completion]" in proc.stderr


def test_an_unknown_shell_is_a_usage_error() -> None:
    proc = torchrepro(Path.cwd(), "completion", "fish")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_the_cli_does_not_import_shtab_until_asked() -> None:
    code = (
        "import sys; from torchrepro.cli import build_parser; build_parser().parse_args(['status']); "
        "print('shtab' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=user_env(), timeout=60
    )
    assert proc.stdout.strip() == "False", proc.stderr
