"""README stays a README for a user and cannot rot silently: exactly two set-up commands at its
top, and .ci/run runs the test one and the slow rest; at most 250 lines; every `flexplan <command>`
and flag it names exists in the CLI; its Python snippets compile; the benchmark scripts it names
exist; and the relative links of README and the docs point at files (and headings) that exist."""

import contextlib
import glob
import io
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
MAX_LINES = 250


def readme() -> str:
    with open(README) as f:
        return f.read()


def setup_commands():
    head = readme().split("\n## ", 1)[0]
    return re.findall(r"^    (pip install .+)$", head, flags=re.M)


def _without_quiet(cmd: str) -> str:
    return " ".join(w for w in cmd.split() if w != "-q")


def test_two_setup_commands_and_ci_runs_the_test_one_then_the_slow_rest():
    cmds = setup_commands()
    assert len(cmds) == 2, cmds
    demo, tests = cmds
    assert demo.endswith("flexplan run") and tests.endswith("python -m pytest -q")
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = [l.strip() for l in f if l.strip() and not l.lstrip().startswith("#")]
    ci_cmd = _without_quiet([l for l in ci if l.startswith("pip install")][0])
    want = _without_quiet(tests)
    assert ci_cmd == want or ci_cmd.startswith(want + " "), (ci_cmd, want)
    assert any(re.search(r"\bpytest\b.*\s-m\s+[\"']?slow\b", l) for l in ci), ".ci/run must also run -m slow"


def test_readme_is_short():
    n = len(readme().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; depth belongs in docs/"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def test_python_snippets_compile():
    blocks = _python_blocks(readme())
    assert blocks
    for i, src in enumerate(blocks):
        compile(src, f"README.md python block {i + 1}", "exec")


def _shell_snippets(text: str) -> list[str]:
    """Inline code spans and 4-space indented lines: where README writes commands."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # fenced blocks are Python
    spans = re.findall(r"`([^`\n]+)`", text)
    indented = re.findall(r"^    (\S.*)$", text, flags=re.M)
    return [s.replace("\\|", "|") for s in spans + indented]


def flexplan_commands() -> dict[str, set[str]]:
    """{subcommand: flags} for every `flexplan <subcommand> ...` README writes."""
    used: dict[str, set[str]] = {}
    for snippet in _shell_snippets(readme()):
        for m in re.finditer(r"(?:^|&& )flexplan (\w[\w-]*)([^&#]*)", snippet):
            sub, rest = m.group(1), re.sub(r"\"[^\"]*\"", "", m.group(2))
            used.setdefault(sub, set()).update(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", rest))
    return used


def _help(*args: str) -> str:
    """What `flexplan ARGS --help` prints (through the console script's entry point, in this process)."""
    from flexplan.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code in (0, None), out.getvalue()[-2000:]
    return out.getvalue()


def test_every_flexplan_command_and_flag_readme_names_exists():
    used = flexplan_commands()
    assert {"run", "explain", "calibrate"} <= set(used), used
    listed = re.search(r"\{([\w,-]+)\}", _help()).group(1).split(",")
    missing = sorted(set(used) - set(listed))
    assert not missing, f"README names flexplan {missing}; `flexplan --help` lists {listed}"
    for sub, flags in used.items():
        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", _help(sub)))
        assert flags <= known, f"flexplan {sub}: README names {sorted(flags - known)}, not in its --help"


def test_benchmark_scripts_readme_names_exist():
    for script in set(re.findall(r"python (benchmarks/[\w/]+\.py)", readme())):
        assert os.path.isfile(os.path.join(REPO, script)), script


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path) as f:
        return {_slug(h) for h in re.findall(r"^#+ (.+)$", f.read(), flags=re.M)}


DOCS = ["README.md", "calibration/README.md", "benchmarks/README.md", *sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_point_at_files_and_headings_that_exist(doc):
    path = os.path.join(REPO, doc)
    if not os.path.exists(path):
        pytest.skip(f"no {doc}")
    with open(path) as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        assert os.path.exists(dest), f"{doc}: link to {target}: no {os.path.relpath(dest, REPO)}"
        if anchor and dest.endswith(".md"):
            assert anchor in _anchors(dest), f"{doc}: link to {target}: no such heading"
