"""Each responsibility has one owner (that ``shardio`` imports nothing of preprocess / Ray / Pillow / YAML /
typer is tests/project/test_package.py's): ``preprocess`` never opens, renames or removes a file in a dataset
directory itself (only ``shardio.write.directory`` and the writer it stages for do); every exception is in the
one tree of ``shardio.errors``, and the exit codes derive from it."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

import preprocess
import shardio
from shardio import errors
from shardio.store.paths import check_local

PREPROCESS_DIR = pathlib.Path(preprocess.__file__).parent
SHARDIO_DIR = pathlib.Path(shardio.__file__).parent
BENCH_DIR = SHARDIO_DIR.parent / "bench"  # not installed: the benchmarks beside the packages

# Calls that create, change or remove files, as "module.function" (after resolving `import x as y`).
MUTATING_CALLS = {
    *(f"os.{name}" for name in ("replace", "rename", "renames", "remove", "unlink", "rmdir", "removedirs",
                                "makedirs", "mkdir", "link", "symlink", "truncate", "ftruncate", "open",
                                "fdopen", "mkfifo")),
    *(f"local.{name}" for name in ("atomic_writer", "lock", "sync_dir")),  # shardio.store.local's helpers
}
# Methods of a ``Storage`` (``shardio.store.base``) that create, change or remove files, called on any object
# (``for_path(p).publish(...)``, ``store.promote(...)``); ``remove`` only on a backend (lists have one too).
STORAGE_WRITES = {"publish", "publish_new", "promote", "create_temp", "upload", "makedirs", "lock", "barrier"}
MUTATING_MODULES = ("shutil", "tempfile")  # any call into them
PATH_METHODS = {"write_bytes", "write_text", "mkdir", "unlink", "rmdir", "touch"}
PATH_MOVES = {"rename", "replace"}  # pathlib's take one argument; str.replace takes two
# Names that build a path inside a dataset directory: only the protocol's modules in shardio.write (and
# format/reader) use them.
DATASET_PATH_NAMES = {"MANIFEST_NAME", "SHARDS_DIR", "REPORTS_DIR", "MANIFESTS_DIR", "generation_path",
                      "LOCK_NAME", "TEMP_PREFIX"}

# The named exceptions: file writes of preprocess that are not in a dataset directory.
ALLOWED = {
    ("cli.py", "open"): "--log-file: the structured log, appended where the user says",
    ("cli.py", "Path.write_bytes"): "--report FILE: a copy of the run report where the user says",
    ("cli.py", "Path.mkdir"): "--report FILE: its parent folder",
    ("diagnose.py", "os.remove"): "diagnose: its own scratch folder for timing shard writes",
    ("diagnose.py", "tempfile.mkdtemp"): "diagnose: creates that scratch folder",
    ("diagnose.py", "shutil.rmtree"): "diagnose: removes that scratch folder",
    ("cluster/ray_output.py", "os.fdopen"): "reads the pipe Ray's output is routed through (mode rb)",
    ("cluster/ray_watchdog.py", "shutil.rmtree"): "removes the session folder of a Ray instance the run started",
    ("cluster/ray_watchdog.py", "os.unlink"): "removes Ray's session_latest link that would dangle",
    ("sample_data.py", "tarfile.open"): "`preprocess sample-data`: writes input tars, not a dataset",
    ("sample_data.py", "os.replace"): "... renames a finished input tar into place",
    ("sample_data.py", "os.makedirs"): "... creates the inputs' folder",
    ("sample_data.py", "open"): "... writes .sample-dataset.json beside the tars (its deliberate failures)",
    ("inputs/folder_samples.py", "os.open"): "reads a file of an input folder (O_RDONLY)",
}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted origin for the module's imports (``from shardio.store.local import lock`` etc.)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _short(origin: str) -> str:
    """``shardio.store.local.lock`` -> ``local.lock``; ``os.path.join`` -> ``os.path.join``."""
    return ".".join(origin.split(".")[-2:]) if origin.startswith("shardio.") else origin


def _open_mode(call: ast.Call) -> str:
    keyword = next((k.value for k in call.keywords if k.arg == "mode"), None)
    mode = call.args[1] if len(call.args) > 1 else keyword
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"


def file_writes(source: str) -> list[tuple[int, str]]:
    """(line, call) for every call in ``source`` that can create, change or remove a file."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in DATASET_PATH_NAMES:
            found.append((node.lineno, node.id))
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name in DATASET_PATH_NAMES]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            origin = _short(aliases.get(func.id, func.id))
            if origin == "open" and set(_open_mode(node)) & set("wax+"):
                found.append((node.lineno, "open"))
            elif origin in MUTATING_CALLS or origin.split(".")[0] in MUTATING_MODULES:
                found.append((node.lineno, origin))
        elif isinstance(func, ast.Attribute):
            base = func.value
            if isinstance(base, ast.Name):
                origin = _short(f"{aliases.get(base.id, base.id)}.{func.attr}")
                if origin in MUTATING_CALLS or origin.split(".")[0] in MUTATING_MODULES:
                    found.append((node.lineno, origin))
                    continue
                if origin == "tarfile.open" and set(_open_mode(node)) & set("wax"):
                    found.append((node.lineno, origin))
                    continue
            is_module = isinstance(base, ast.Name) and base.id in aliases
            on_backend = (isinstance(base, ast.Call) and isinstance(base.func, ast.Name)
                          and aliases.get(base.func.id, "").endswith("backends.for_path"))
            if not is_module and (func.attr in STORAGE_WRITES or (func.attr == "remove" and on_backend)):
                found.append((node.lineno, f"Storage.{func.attr}"))
                continue
            moves = func.attr in PATH_MOVES and len(node.args) == 1
            if not is_module and (func.attr in PATH_METHODS or moves):
                found.append((node.lineno, f"Path.{func.attr}"))
    return found


def test_the_scanner_finds_each_kind_of_write():
    source = (
        "import os, shutil, tempfile\nfrom shardio.store.backends import for_path\n"
        "from shardio.store.local import atomic_writer\nfrom shardio.format import SHARDS_DIR\n"
        "os.replace(a, b)\nos.remove(a)\nshutil.rmtree(d)\ntempfile.mkstemp()\nopen(p, 'wb')\n"
        "open(p, mode='a')\nopen(p)\np.write_text('x')\np.rename(q)\nname.replace('a', 'b')\n"
        "for_path(p).publish(p, b'')\nfor_path(p).remove(p)\nstore.promote(a, b)\natomic_writer(p)\n"
        "items.remove(x)\nfor_path(d).join(d, SHARDS_DIR)\n"
    )
    calls = [call for _, call in file_writes(source)]
    assert calls.count("SHARDS_DIR") == 2  # the import and the use
    assert calls.count("Path.rename") == 1 and "Path.replace" not in calls  # str.replace is no file move
    for call in ("os.replace", "os.remove", "shutil.rmtree", "tempfile.mkstemp", "Path.write_text",
                 "Storage.publish", "Storage.remove", "Storage.promote", "local.atomic_writer"):
        assert call in calls, call
    assert calls.count("open") == 2  # 'wb' and mode='a'; a read is not a write
    assert calls.count("Storage.remove") == 1  # a list's remove is no file removal


def test_preprocess_writes_no_file_in_a_dataset_directory_itself():
    unexpected = []
    seen = set()
    for path in sorted(PREPROCESS_DIR.rglob("*.py")):
        name = path.relative_to(PREPROCESS_DIR).as_posix()
        for line, call in file_writes(path.read_text(encoding="utf-8")):
            seen.add((name, call))
            if (name, call) not in ALLOWED:
                unexpected.append(f"preprocess/{name}:{line}: {call}")
    assert not unexpected, ("file writes or dataset paths outside shardio.write.directory (go through it, or name "
                            "the exception in ALLOWED with why): " + "; ".join(unexpected))
    assert not set(ALLOWED) - seen, f"stale exceptions: {sorted(set(ALLOWED) - seen)}"



def _exception_classes(folder: pathlib.Path) -> list[str]:
    """Classes defined in ``folder``'s modules that derive from an ...Error / Exception base."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                if any(b.endswith(("Error", "Exception")) or b in errors.__all__ for b in bases):
                    found.append(f"{path.relative_to(folder.parent).as_posix()}:{node.name}")
    return found


# Exceptions internal to one module that never leave it (not part of the public tree).
INTERNAL_EXCEPTIONS = {"preprocess/image/jpeg_markers.py:ScanDataEnded"}


def test_every_exception_lives_in_the_one_tree():
    outside = [name for name in _exception_classes(PREPROCESS_DIR) + _exception_classes(SHARDIO_DIR)
               if not name.startswith("shardio/errors.py:") and name not in INTERNAL_EXCEPTIONS]
    assert not outside, f"exceptions outside shardio/errors.py: {outside}"
    doc = errors.__doc__ or ""
    for name in errors.__all__:
        member = getattr(errors, name)
        if inspect.isclass(member):
            assert issubclass(member, errors.ShardioError), name
            assert name in doc, f"{name} is not drawn in the tree of the errors docstring"


@pytest.mark.parametrize(("error", "code"), [
    (errors.ConfigError("x"), 2), (errors.NoInputsMatched("x"), 2), (errors.OutputLocked("x"), 2),
    (errors.OutputUnusable("x"), 2), (errors.PruneRefused("x"), 2), (errors.RayUnavailable("x"), 2),
    (errors.UnsupportedPath("x"), 2), (errors.DatasetIncompatibleError("x"), 2),
    (errors.VersionDrift("x"), 2),
    (errors.ShardError("x"), 1), (errors.ShardFormatError("x"), 1), (errors.ShardIntegrityError("x"), 1),
    (errors.OutputFull("x"), 1), (errors.InputError("a.tar", "bad"), 1),
])
def test_exit_codes_derive_from_the_tree(error, code):
    assert errors.exit_code(error) == code


def test_compatibility_bases_are_kept():
    # Callers that caught the old bases still do: ConfigError was a ValueError, a URL a NotImplementedError.
    assert issubclass(errors.ConfigError, ValueError)
    with pytest.raises(NotImplementedError, match="s3://"):
        check_local("s3://bucket/ds")


# --- the import graph: no circles, and no first-party import hidden in a function ---------------------

# Function-level imports of a first-party module, each with why it is not at the top. Optional heavy
# dependencies (obstore, boto3, xxhash, lightning, PIL, ray, typer...) are third-party: not checked here.
LAZY_FIRST_PARTY = {
    ("shardio.tools.commands", "shardio.tools.loader_bench"): "imports torch (~1 s): only `shardio bench` pays for it",
    ("preprocess.models.input_models", "preprocess.models.runner"):
        "imports torch (~1 s): only a task running a model itself (replicas: 0) pays for it",
    ("preprocess.models.input_models", "preprocess.models.identity"):
        "imports torch (~1 s): only a task running a model itself (replicas: 0) pays for it",
    ("preprocess.models.recorded_outputs", "preprocess.models.identity"):
        "imports torch (~1 s): only a run with `models:` pays for it",
    ("preprocess.models.replicas", "preprocess.models.replica_core"): "imports torch (~1 s): only a replica's process "
                                                                      "pays for it, never a task or the driver",
}


def _module_names(folders: tuple[pathlib.Path, ...] = (SHARDIO_DIR, PREPROCESS_DIR)) -> dict[str, pathlib.Path]:
    """Every module of ``folders`` (``shardio`` and ``preprocess`` unless told) by dotted name (a package by
    its ``__init__``); not what the benches write under ``bench/out`` (a peer's virtual environment, a stock
    Pillow)."""
    found = {}
    for folder in folders:
        for path in folder.rglob("*.py"):
            if path.is_relative_to(BENCH_DIR / "out"):
                continue
            parts = path.relative_to(folder.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _function_imports(tree: ast.AST) -> set[int]:
    """ids of the import statements inside a function (run at call time, not at import)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(sub) for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom)))
    return inside


def import_graph(modules: dict[str, str]) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(module -> first-party modules it imports, by any statement anywhere in it; the function-level ones
    as (module, imported, line)) for sources given as {dotted name: source}."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    lazy = []
    for name, source in modules.items():
        tree = ast.parse(source)
        in_function = _function_imports(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # ``from pkg import mod`` imports pkg.mod; ``from mod import name`` imports mod
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                           else node.module for alias in node.names]
            else:
                continue
            for target in {resolve(t) for t in targets} - {None, name}:
                graph[name].add(target)  # type: ignore[arg-type]
                if id(node) in in_function:
                    lazy.append((name, target, node.lineno))
    return graph, lazy


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` as [a, b, ..., a], or [] if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_graph_builder_sees_function_level_imports_and_circles():
    modules = {"shardio.a": "from shardio import b\n", "shardio.b": "def f():\n    from shardio.c import x\n",
               "shardio.c": "import shardio.a\nimport os\n", "shardio": ""}
    graph, lazy = import_graph(modules)
    assert graph["shardio.a"] == {"shardio.b"} and graph["shardio.c"] == {"shardio.a"}
    assert lazy == [("shardio.b", "shardio.c", 2)]
    assert find_cycle(graph) == ["shardio.a", "shardio.b", "shardio.c", "shardio.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) == []


def test_shardio_and_preprocess_have_no_import_circle():
    graph, _ = import_graph({name: path.read_text(encoding="utf-8") for name, path in _module_names().items()})
    assert not find_cycle(graph), f"import circle: {' -> '.join(find_cycle(graph))}"
    assert not any(name.startswith("shardio") and any(t.startswith("preprocess") for t in targets)
                   for name, targets in graph.items()), "shardio imports preprocess"


def test_storage_is_the_lower_layer():
    """``shardio.store`` imports only the exception tree and itself: the format, the writer and the reader
    sit on it (the checksums a manifest names are storage's, ``shardio/store/checksum.py``)."""
    graph, _ = import_graph({name: path.read_text(encoding="utf-8") for name, path in _module_names().items()})
    upward = [f"{name} imports {target}" for name, targets in graph.items() if name.startswith("shardio.store")
              for target in targets
              if target not in ("shardio.errors", "shardio.store") and not target.startswith("shardio.store.")]
    assert not upward, f"shardio.store imports above itself: {upward}"


def test_no_first_party_import_is_hidden_in_a_function():
    _, lazy = import_graph({name: path.read_text(encoding="utf-8") for name, path in _module_names().items()})
    hidden = [f"{name}:{line} imports {target}" for name, target, line in lazy
              if (name, target) not in LAZY_FIRST_PARTY]
    assert not hidden, ("a function-level import of a first-party module (move it to the top; if it dodged a "
                        f"circle, the piece is misplaced; or name it in LAZY_FIRST_PARTY with why): {hidden}")
    assert {(name, target) for name, target, _ in lazy} == set(LAZY_FIRST_PARTY), "stale LAZY_FIRST_PARTY"


def test_bench_has_no_import_circle_and_nothing_imports_it():
    """bench/ sits on top: it imports shardio and preprocess, never the reverse, and its own modules import
    one way (a piece two benchmarks share lives in a module of its own, e.g. ``bench/copy_baseline.py``)."""
    sources = {name: path.read_text(encoding="utf-8")
               for name, path in _module_names((SHARDIO_DIR, PREPROCESS_DIR, BENCH_DIR)).items()}
    graph, _ = import_graph(sources)
    bench_graph = {name: {t for t in targets if t.startswith("bench")}
                   for name, targets in graph.items() if name.startswith("bench")}
    assert not find_cycle(bench_graph), f"import circle in bench/: {' -> '.join(find_cycle(bench_graph))}"
    upward = [f"{name} imports {target}" for name, targets in graph.items() if not name.startswith("bench")
              for target in targets if target.startswith("bench")]
    assert not upward, f"shardio / preprocess import bench/: {upward}"
    assert any(t.startswith("shardio") for name in bench_graph for t in graph[name]), "bench/ was not read"


# The openers: the only functions that turn a path into its storage backend (``shardio.store.backends.for_path``),
# named with why, as the lazy imports are above. A place is opened once (a ``DatasetRoot``: the path and its
# backend) and passed down; everything below asks ``root.storage`` and never looks at the scheme again.
OPENERS = {
    ("shardio/store/root.py", "open_root"): "a dataset's directory, its path normalised once (one lock key, one "
                                           "identity per dataset); a public function of format/, read/, write/ "
                                           "given a path opens it here, given a root passes it on",
    ("shardio/store/root.py", "open_input"): "an input (a file, a folder, a prefix named URL/, a glob) with its path "
                                            "as given; a root unpickled in a task or a DataLoader worker",
}

# Where preprocess opens an input from its path (``open_input``), named as the openers are: the driver
# resolving the INPUT arguments (each expansion once) and reading the head of a name that claims no kind, the
# task opening its input once (the stem's fingerprint and the reader are given it), the access probe of every
# node, ``verify --repair`` and ``diagnose``. The readers of each kind take the input opened already (then
# ``open_input`` returns it as it is) or, called directly, its path.
INPUT_OPENERS = {
    ("preprocess/inputs/resolve.py", "resolve_inputs"), ("preprocess/inputs/resolve.py", "_refuse_unreadable"),
    ("preprocess/worker.py", "iter_process_input"), ("preprocess/worker.py", "shard_stem"),
    ("preprocess/cluster/cluster_access.py", "task_env"), ("preprocess/cluster/cluster_access.py", "_inputs_to_probe"),
    ("preprocess/cluster/cluster_access.py", "probe_access"),
    ("preprocess/cluster/cluster_access.py", "check_cluster_access"),
    ("preprocess/verify.py", "repair_dataset"), ("preprocess/diagnose.py", "diagnose"),
    ("preprocess/inputs/kinds.py", "input_kind"), ("preprocess/inputs/kinds.py", "samples_of"),
    ("preprocess/inputs/kinds.py", "KindReader.__call__"),
    ("preprocess/inputs/tar_samples.py", "index_tar"), ("preprocess/inputs/tar_samples.py", "iter_tar_samples"),
    ("preprocess/inputs/parquet_samples.py", "iter_parquet_samples"),
    ("preprocess/inputs/folder_samples.py", "folder_source"),
    ("preprocess/inputs/folder_samples.py", "iter_folder_samples"),
}


def uses_of(name: str, root: pathlib.Path, packages: tuple[pathlib.Path, ...]) -> dict[tuple[str, str], int]:
    """Each function's references to ``name`` (calls, and the name passed on, as ``map(for_path, ...)``), by
    (module, qualified function name; "" at module level)."""
    found: dict[tuple[str, str], int] = {}

    def visit(node: ast.AST, module: str, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, module, [*scope, child.name])
                continue
            if isinstance(child, ast.Name) and child.id == name and isinstance(child.ctx, ast.Load):
                key = (module, ".".join(scope))
                found[key] = found.get(key, 0) + 1
            visit(child, module, scope)

    for package in packages:
        for path in sorted(package.rglob("*.py")):
            visit(ast.parse(path.read_text(encoding="utf-8")), path.relative_to(root).as_posix(), [])
    return found


def test_the_counter_sees_calls_and_the_name_passed_on(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("from s import for_path\nx = for_path(p)\n\n\nclass A:\n    def f(self):\n"
                                  "        return list(map(for_path, ps))\n")
    (package / "b.py").write_text("def for_path(p):\n    return p\n")  # a definition is not a use
    assert uses_of("for_path", tmp_path, (package,)) == {("pkg/a.py", ""): 1, ("pkg/a.py", "A.f"): 1}


def test_only_the_openers_choose_a_backend():
    found = uses_of("for_path", SHARDIO_DIR.parent, (SHARDIO_DIR, PREPROCESS_DIR))
    others = sorted(set(found) - set(OPENERS))
    assert not others, ("for_path outside the openers (module, function): take the DatasetRoot the caller opened "
                        f"(shardio.store.root) instead of choosing the backend again: {others}")
    assert set(found) == set(OPENERS) and all(count == 1 for count in found.values()), f"stale OPENERS: {found}"


def test_preprocess_opens_an_input_only_where_named():
    found = set(uses_of("open_input", SHARDIO_DIR.parent, (PREPROCESS_DIR,)))
    assert not found - INPUT_OPENERS, ("an input opened from its path again (module, function): pass the input "
                                       f"its caller opened, or name the new opener in INPUT_OPENERS: "
                                       f"{sorted(found - INPUT_OPENERS)}")
    assert found == INPUT_OPENERS, f"stale INPUT_OPENERS: {sorted(INPUT_OPENERS - found)}"
