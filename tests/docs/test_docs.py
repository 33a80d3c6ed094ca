"""The documentation: ``sphinx-build -W`` builds it without a warning (offline: intersphinx reads
the local inventories of ``docs/conf.py``), every public name has a reference entry, and the
code in it runs — the scripts under ``docs/code`` (alone, or as a cluster of a ``pccl master``
process and peer processes, as their ``# docs-test:`` line says), every ``python`` code block of
a page (in order, in one namespace per page), and every ``pccl``/``pccl-sim`` command line of a
``console`` block parses with the real argument parser.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import pytest

import pccl
import pccl.blocking

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CODE = DOCS / "code"
PAGES = sorted(DOCS.rglob("*.rst"))

sphinx = pytest.importorskip("sphinx", reason="the docs extra is not installed (pip install -e '.[docs]')")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PCCL_DOCS_ONLINE", None)
    env.pop("PCCL_TOKEN", None)
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("docs-html")
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                             "-d", str(out / ".doctrees"), str(DOCS), str(out)],
                            capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, f"sphinx-build -W failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_the_site_builds_without_a_warning(built: pathlib.Path) -> None:
    for page in ("index", "tutorial", "concepts", "operating", "simulator", "protocol", "performance", "gpu",
                 "streaming", "changelog", "reference/pccl", "reference/blocking", "reference/commands"):
        assert (built / f"{page}.html").is_file(), page


def _inventory(built: pathlib.Path) -> dict[str, set[str]]:
    from sphinx.util.inventory import InventoryFile

    with open(built / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", posixpath_join)
    data = inventory.data if hasattr(inventory, "data") else inventory
    return {role: set(entries) for role, entries in data.items()}


def posixpath_join(*parts: str) -> str:
    return "/".join(parts)


def test_every_public_name_has_a_reference_entry(built: pathlib.Path) -> None:
    entries = _inventory(built)
    python = set().union(*(names for role, names in entries.items() if role.startswith("py:")))
    missing = [f"pccl.{name}" for name in pccl.__all__ if f"pccl.{name}" not in python]
    missing += [f"pccl.blocking.{name}" for name in pccl.blocking.__all__ if f"pccl.blocking.{name}" not in python]
    for method in ("all_reduce", "all_reduce_many", "sync_shared_state", "update_topology", "are_peers_pending",
                   "optimize_topology", "all_reduce_async", "all_reduce_many_async", "steps", "close"):
        if f"pccl.blocking.Communicator.{method}" not in python:
            missing.append(f"pccl.blocking.Communicator.{method}")
    assert missing == []


def test_every_command_line_flag_has_a_reference_entry(built: pathlib.Path) -> None:
    from pccl.tools.cli import _build_parser
    from pccl_sim.tools.cli import _parser

    sys.path.insert(0, str(DOCS / "_ext"))
    from pccl_docs import command_flags

    documented = _inventory(built).get("std:cmdoption", set())  # "pccl-master.--listen"
    expected = command_flags(_build_parser(), "pccl") | command_flags(_parser(), "pccl-sim")
    assert "pccl-master.--listen" in expected and "pccl-sim-run.--seed" in expected
    assert sorted(expected - documented) == []


# --- code ------------------------------------------------------------------------------------------


def _blocks(page: pathlib.Path, language: str) -> list[str]:
    """The bodies of ``.. code-block:: <language>`` directives of ``page``, dedented."""
    lines = page.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = re.match(r"^(\s*)\.\. code-block:: (\S+)\s*$", lines[i])
        i += 1
        if not match or match.group(2) != language:
            continue
        indent = len(match.group(1))
        while i < len(lines) and re.match(r"^\s+:\w[\w-]*:", lines[i]):
            i += 1  # the directive's options
        body = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        text = "\n".join(body).strip("\n")
        width = min((len(line) - len(line.lstrip()) for line in text.splitlines() if line.strip()), default=0)
        blocks.append("\n".join(line[width:] for line in text.splitlines()))
    return blocks


PYTHON_PAGES = [page for page in PAGES if _blocks(page, "python")]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_the_python_blocks_of_a_page_run(page: pathlib.Path, tmp_path: pathlib.Path) -> None:
    script = tmp_path / "blocks.py"
    script.write_text("\n\n".join(f"# --- block {i}\n{b}" for i, b in enumerate(_blocks(page, "python"))) + "\n")
    result = subprocess.run([sys.executable, "-P", str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, f"{page.name}:\n{script.read_text()}\n{result.stdout}\n{result.stderr}"


def _header(script: pathlib.Path) -> list[str]:
    first = script.read_text().splitlines()[0]
    assert first.startswith("# docs-test: "), f"{script.name} has no '# docs-test:' first line"
    return shlex.split(first.removeprefix("# docs-test: "))


def _run_cluster(script: pathlib.Path, peers: int, args: list[str], cwd: pathlib.Path) -> str:
    env = _env()
    master = subprocess.Popen([sys.executable, "-P", "-m", "pccl", "master", "--listen", "127.0.0.1:0"],
                              cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = []
    try:
        assert master.stderr is not None
        address = None
        deadline = time.monotonic() + 60
        while address is None and time.monotonic() < deadline:
            line = master.stderr.readline()
            if not line:
                break
            log.append(line)
            found = re.search(r"master listening on (\S+)", line)
            address = found.group(1) if found else None
        assert address, "the master did not say where it listens:\n" + "".join(log)
        procs = [subprocess.Popen([sys.executable, "-P", str(script), "--master", address, *args], cwd=cwd, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(peers)]
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                out, _ = proc.communicate()
            outputs.append(out)
            assert proc.returncode == 0, f"{script.name} failed:\n" + "\n---\n".join(outputs)
        return "\n---\n".join(outputs)
    finally:
        master.terminate()
        master.wait(30)


def _run_script(script: pathlib.Path, cwd: pathlib.Path) -> str:
    header = _header(script)
    if header[0] == "run":
        result = subprocess.run([sys.executable, "-P", str(script)], cwd=cwd, env=_env(), capture_output=True,
                                text=True, timeout=180)
        assert result.returncode == 0, f"{script.name}:\n{result.stdout}\n{result.stderr}"
        return result.stdout
    assert header[0] == "cluster", header
    return _run_cluster(script, int(header[1]), header[2:], cwd)


SCRIPTS = sorted(CODE.glob("*.py"))


def test_the_scripts_run(tmp_path: pathlib.Path) -> None:
    # Run side by side: most of their time is processes starting and importing.
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {pool.submit(_run_script, script, tmp_path): script for script in SCRIPTS}
        for future, script in futures.items():
            output = future.result()
            assert output.strip(), f"{script.name} printed nothing"


def test_every_script_is_shown_by_a_page() -> None:
    included = set(re.findall(r"literalinclude:: (?:\.\./)*code/(\S+\.py)", "\n".join(p.read_text() for p in PAGES)))
    assert {s.name for s in SCRIPTS} <= included, sorted({s.name for s in SCRIPTS} - included)
    for script in SCRIPTS:
        _header(script)


def test_the_command_lines_shown_parse() -> None:
    from pccl.tools.cli import _build_parser
    from pccl_sim.tools.cli import _parser

    parsers = {"pccl": _build_parser, "pccl-sim": _parser}
    checked = 0
    for page in PAGES:
        for block in _blocks(page, "console"):
            for line in block.splitlines():
                if not line.startswith("$ "):
                    continue
                words = shlex.split(line[2:], comments=True)
                while words and "=" in words[0]:  # VAR=value prefixes
                    words.pop(0)
                if not words or words[0] not in parsers:
                    continue
                argv = [w for w in words[1:]]
                try:
                    parsers[words[0]]().parse_args(argv)
                except SystemExit as exc:
                    assert exc.code == 0, f"{page.name}: {line!r} does not parse"
                checked += 1
    assert checked >= 10, checked


def test_no_page_points_outside_the_repository() -> None:
    for page in [*PAGES, ROOT / "README.md"]:
        text = page.read_text()
        assert "../shared" not in text and "SPEC §" not in text, page


def test_the_readme_links_into_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)", readme)
    for page in ("docs/index.rst", "docs/tutorial.rst", "docs/concepts.rst", "docs/operating.rst",
                 "docs/simulator.rst", "docs/protocol.rst", "docs/performance.rst", "docs/gpu.rst",
                 "docs/reference/index.rst", "CHANGELOG.md"):
        assert page in targets, f"the README does not link {page}"
    for target in targets:
        assert (ROOT / target).exists(), f"the README links {target}, which does not exist"
