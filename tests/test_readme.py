"""README keeps exactly two set-up commands at its top, and .ci/run runs the test one."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    head = text.split("\n## ", 1)[0]
    return re.findall(r"^    (pip install .+)$", head, flags=re.M)


def test_two_setup_commands_and_ci_runs_the_test_one():
    cmds = setup_commands()
    assert len(cmds) == 2, cmds
    demo, tests = cmds
    assert demo.endswith("flexplan run") and "pytest" in tests
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    ci_cmd = [l for l in ci.splitlines() if l.startswith("pip install")][0]
    assert ci_cmd.replace(" -q", "") == tests.replace(" -q", "") + " -q" or ci_cmd.replace(" -q", "") == tests.replace(" -q", "")
