"""How far the tests reach into pccl, counted from the source (nothing is imported to count it).

Tests drive pccl through its public face and :mod:`pccl.testing` (as trio's tests use
:mod:`trio.testing`); the rest is a budget, counted over every ``*.py`` under ``tests/``
except this file and ``tests/unit/test_layering.py`` (whose tables and planted violations are
data about pccl's modules, not reaches into them).  Each node of the syntax tree counts once;
docstrings and comments do not count.

(a) **seams** — the whole-object hooks the issue retires, at most :data:`SEAM_BUDGET`:

* a call of ``session(...)`` or ``sync_service(...)`` of ``pccl.testing`` (whole ``PeerSession``
  or sync service handed out);
* an attribute ``x.p2p`` (the communicator's ring connections) and ``<…master…>.state``
  (the master's consensus machine: any ``.state`` on a name or attribute whose name says
  ``master``);
* an import of ``pccl._peer…`` or ``pccl.net._frames`` (``import``, ``from … import``, and
  ``from pccl import _peer``).

(b) **private reaches** into pccl, at most :data:`PRIVATE_BUDGET`:

* an import whose module path or imported name has a private part (``pccl._kernels``,
  ``from pccl.x import _y``);
* an attribute chain rooted at the name ``pccl`` with a private part (``pccl._peer.sync``);
* ``x._name`` (dunders excepted) where ``x`` is not ``self``/``cls`` and not rooted at a name
  imported from outside pccl (trio's own scheduling hooks are trio's business);
* a string constant (not a docstring) that names a private module of pccl
  (``"pccl._peer.wiring"``, a logger's name).

(This budget replaced test_layering.py's older count of every ``x._name`` in tests, which also
counted the torch privates that ported upstream tests call, such as DDP's ``_set_static_graph``.
Those are torch's business, not reaches into pccl: a name in :data:`TORCH_PRIVATES` is not
counted, and :func:`test_torch_private_names_are_not_pccl_names` checks that pccl's source
defines no such name, so the exemption cannot hide a reach into pccl.)

(c) no test imports another test module's private helper (``from test_x import _helper``): what
tests share is public in the module that holds it, or belongs in :mod:`pccl.testing`.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: Files whose contents are data about pccl's modules (the layering rules and their plants).
NOT_COUNTED = {pathlib.Path(__file__).resolve(), TESTS.joinpath("unit", "test_layering.py").resolve()}
SEAM_BUDGET = 10
PRIVATE_BUDGET = 20
SEAM_MODULES = ("pccl._peer", "pccl.net._frames")
#: Private names of torch's own objects that PyTorch's tests, ported to pccl.torch, call as
#: upstream does (DDP's logging data and join config, a process group's name setters, ...).
TORCH_PRIVATES = frozenset({
    "_get_ddp_logging_data", "_set_group_name", "_set_group_desc", "_join_config",
    "_default_broadcast_coalesced", "_set_static_graph", "_get_debug_mode",
    "_build_debug_param_to_name_mapping", "_module_copies", "_delay_all_reduce_params",
    "_register_fused_optim", "_remove_autograd_hooks", "_get_data_parallel_params",
    "_check_default_group", "_distributed_broadcast_coalesced", "_sync_module_states",
    "_set_params_and_buffers_to_ignore_for_model", "_set_ddp_runtime_logging_sample_rate", "_get_default_store",
    "_register_builtin_comm_hook", "_register_buffer_comm_hook", "_set_ddp_sink_clone", "_overloadpacket",
    "_authoritative_rank", "_build_params_for_reducer",
    "_fields",  # a namedtuple's field names (Python's public API), which upstream's DDP test reads
})
PRIVATE_PATH = re.compile(r"\bpccl(\.[A-Za-z0-9_]+)*\._[A-Za-z][A-Za-z0-9_]*")


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _imports(tree: ast.Module) -> Iterator[tuple[ast.stmt, str, list[str]]]:
    """Each import as (node, module, imported names)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node, node.module, [alias.name for alias in node.names]


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names bound by imports from outside pccl (trio's ``_run`` and the like)."""
    names = set()
    for node, module, imported in _imports(tree):
        if _within(module, ("pccl",)):
            continue
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        else:
            names.update(a.asname or a.name for a in node.names)  # type: ignore[attr-defined]
    return names


def _testing_names(tree: ast.Module) -> set[str]:
    """``session``/``sync_service`` names imported from pccl.testing."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "pccl.testing":
            names.update(a.asname or a.name for a in node.names if a.name in ("session", "sync_service"))
    return names


def reaches(path: pathlib.Path, text: str | None = None) -> tuple[list[str], list[str]]:
    """The seams (a) and private reaches (b) in one file, each as ``path:line: code``."""
    source = path.read_text() if text is None else text
    tree = ast.parse(source)
    seams: list[str] = []
    privates: list[str] = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path

    def note(into: list[str], node: ast.AST) -> None:
        into.append(f"{where}:{getattr(node, 'lineno', 0)}: {ast.unparse(node)[:100]}")

    for node, module, imported in _imports(tree):
        if _within(module, SEAM_MODULES) or (module == "pccl" and "_peer" in imported):
            note(seams, node)
        if _within(module, ("pccl",)) and any(_private(p) for p in module.split(".") + imported):
            note(privates, node)
    foreign, testing = _foreign_names(tree), _testing_names(tree)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = _dotted(node.func)
            if func and func[-1] in ("session", "sync_service") and (
                    func[:-1] and func[-2] == "testing" or len(func) == 1 and func[0] in testing):
                note(seams, node.func)
        elif isinstance(node, ast.Attribute):
            if node.attr == "p2p":
                note(seams, node)
            elif node.attr == "state":
                holder = node.value
                name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", "")
                if "master" in name.lower():
                    note(seams, node)
            if not _private(node.attr) or node.attr in TORCH_PRIVATES:
                continue
            dotted = _dotted(node)
            if dotted and dotted[0] == "pccl":
                # Count the chain once, at its outermost private part.
                note(privates, node)
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            root = _root_name(node.value)
            if root in foreign or (dotted is None and root is None):
                continue
            note(privates, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if PRIVATE_PATH.search(node.value):
                note(privates, node)
    return seams, _outermost(privates)


def _outermost(found: list[str]) -> list[str]:
    """``pccl._peer.sync.x`` is one reach, not one per attribute of the chain."""
    kept: list[str] = []
    for entry in sorted(found, key=len, reverse=True):
        location, _, code = entry.partition(": ")
        if not any(k.startswith(location + ": ") and k.partition(": ")[2].startswith(code) for k in kept):
            kept.append(entry)
    return sorted(kept)


def count(root: pathlib.Path = TESTS) -> tuple[list[str], list[str]]:
    seams: list[str] = []
    privates: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() in NOT_COUNTED:
            continue
        a, b = reaches(path)
        seams += a
        privates += b
    return seams, privates


def test_tests_use_few_whole_object_seams() -> None:
    seams, _ = count()
    assert len(seams) <= SEAM_BUDGET, f"{len(seams)} seams (budget {SEAM_BUDGET}):\n" + "\n".join(seams)


def test_tests_reach_few_private_names_of_pccl() -> None:
    _, privates = count()
    assert len(privates) <= PRIVATE_BUDGET, (
        f"{len(privates)} private reaches (budget {PRIVATE_BUDGET}):\n" + "\n".join(privates))


def test_torch_private_names_are_not_pccl_names() -> None:
    """The exempted torch names name nothing in pccl (a def, a class, an assignment or an
    attribute anywhere under pccl/), so ``x._name`` with such a name cannot be a reach into it."""
    pccl_names: set[str] = set()
    for path in (ROOT / "pccl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                pccl_names.add(node.name)
            elif isinstance(node, ast.Attribute):
                pccl_names.add(node.attr)
            elif isinstance(node, ast.Name):
                pccl_names.add(node.id)
    assert not TORCH_PRIVATES & pccl_names, sorted(TORCH_PRIVATES & pccl_names)
    planted = "import torch\nddp = torch.nn.parallel.DistributedDataParallel\nddp._join_config\nx._peer_table\n"
    _, privates = reaches(TESTS / "planted.py", planted)
    assert [p.rpartition(": ")[2] for p in privates] == ["x._peer_table"]


def private_helper_imports(root: pathlib.Path = TESTS) -> list[str]:
    """``from <a module of tests/> import _name`` anywhere under ``root``."""
    helpers = {path.stem for path in root.rglob("*.py")}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in helpers:
                found += [f"{path.relative_to(root)}:{node.lineno}: {node.module}.{alias.name}"
                          for alias in node.names if _private(alias.name)]
    return found


def test_tests_share_no_private_helpers() -> None:
    assert private_helper_imports() == []


def test_the_helper_check_sees_a_private_import(tmp_path: pathlib.Path) -> None:
    (tmp_path / "test_a.py").write_text("def _helper() -> None: ...\n")
    (tmp_path / "test_b.py").write_text("from test_a import _helper\nfrom os import _exit\n")
    assert [entry.rpartition(": ")[2] for entry in private_helper_imports(tmp_path)] == ["test_a._helper"]


def test_the_counter_sees_each_kind_of_reach(tmp_path: pathlib.Path) -> None:
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        '"""A docstring naming pccl._peer.session does not count."""\n'
        "import pccl\n"
        "import pccl.testing\n"
        "from pccl._peer import wiring\n"              # seam + private
        "from pccl.net._frames import FrameCore\n"     # seam + private
        "from pccl.kernels import _oracle\n"           # private
        "from trio._core import _run\n"                # not pccl: nothing
        "def f(comm, master, server):\n"
        "    pccl.testing.session(comm).rewire()\n"   # seam
        "    pccl.testing.sync_service(comm)\n"       # seam
        "    comm.p2p.to_successor()\n"               # seam
        "    master.state.peers()\n"                  # seam
        "    server._conns\n"                         # private
        "    pccl._kernels.lib.x\n"                   # private (once for the chain)
        "    _run._r\n"                               # trio's: nothing
        "    logger = 'pccl._peer.wiring'\n"          # private
        "    self._fine = 1\n")
    seams, privates = reaches(planted)
    assert len(seams) == 6, seams
    assert len(privates) == 6, privates
