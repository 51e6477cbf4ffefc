"""How a ``fastcl`` process ends (``fastcl.cli.exit_process``): ``sys.exit`` normally, and
after ``skip_teardown`` (a run that ended its gloo group, docs/distributed.md) ``os._exit``
with the same status, its output and logs flushed first, the interpreter's teardown
(atexit handlers) skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, logging, sys
from fastcl.cli import exit_process, skip_teardown
logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
logging.info("logged")
atexit.register(lambda: print("teardown ran", flush=True))
print("printed", end="")  # no newline: still in the buffer unless flushed
sys.stderr.write("warned")
if sys.argv[1] == "skip":
    skip_teardown()
exit_process(3)
"""


@pytest.mark.parametrize("mode", ["skip", "plain"])
def test_exit_process_keeps_status_and_output(tmp_path, mode):
    log = tmp_path / "run.log"
    env = {"PYTHONUNBUFFERED": ""}  # a block-buffered stdout, as under a launcher's pipe
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(log)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("printed") and "warned" in done.stderr
    assert "logged" in log.read_text()
    assert ("teardown ran" in done.stdout) == (mode == "plain")
