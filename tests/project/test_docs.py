"""The documentation cannot rot: every shell and Python block in the README and docs/ is marked as run or
illustrative, every command, option, config key and public name it shows exists, every relative link and
anchor resolves, the generated pages match the code, and error messages point to pages that exist."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from docsgen import generate, reference, snippets
from docsgen.reference import ROOT

PAGES = snippets.pages()
BLOCKS = [b for page in PAGES for b in snippets.blocks(page)]
OPTIONS = reference.cli_options()


def test_the_pages_are_found_and_the_readme_fits_a_few_screens():
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "docs/quickstart.md", "docs/guides/troubleshooting.md", "docs/reference/config.md"} <= names
    size = (ROOT / "README.md").stat().st_size
    assert size <= 12 * 1024, f"README.md is {size} bytes: keep it under 12 KB and move the detail to docs/"


def test_every_shell_and_python_block_is_marked_runs_or_illustrative():
    unmarked = [f"{b.where} ({b.lang})" for b in BLOCKS if b.kind and b.marker is None]
    assert not unmarked, ("blocks without <!-- runs --> or <!-- illustrative --> on the line before: "
                          + ", ".join(unmarked))
    assert sum(b.marker == snippets.RUNS for b in BLOCKS) >= 10, "most examples should run"


def test_the_marker_only_marks_what_the_tests_read():
    stray = [b.where for b in BLOCKS if b.marker and not b.kind]
    assert not stray, f"a runs/illustrative marker before a block of another language: {stray}"


def _calls() -> list[tuple[str, tuple[str, str | None, list[str]]]]:
    """Every call of `preprocess` / `shardio` the docs show, in blocks and in inline code."""
    found = []
    for b in BLOCKS:
        if b.kind == "shell":
            for words in snippets.commands(b.code):
                call = snippets.program_call(words)
                if call:
                    found.append((b.where, call))
    for page in PAGES:
        for span in snippets.inline_code(page):
            if re.match(r"^(\.venv/bin/)?(preprocess|shardio) [a-z-]", span):
                call = snippets.program_call(snippets.commands(span.replace("...", "X"))[0])
                if call:
                    found.append((str(page.relative_to(ROOT)), call))
    return found


def test_every_command_and_option_the_docs_show_exists():
    calls = _calls()
    assert len(calls) > 20
    wrong = []
    for where, (program, sub, options) in calls:
        command = f"{program} {sub}" if sub else program
        if sub and command not in OPTIONS:
            wrong.append(f"{where}: `{command}` is no command")
            continue
        wrong += [f"{where}: `{command}` has no option {opt}" for opt in options if opt not in OPTIONS[command]]
    assert not wrong, "\n".join(wrong)


def test_every_option_named_alone_in_prose_is_an_option_of_some_command():
    """`--retain-hours` in a sentence is an option of `preprocess` or `shardio` (the design pages name the
    benchmarks' options too: they are not checked)."""
    every = set().union(*OPTIONS.values())
    other = {"--endpoint-url", "--blob-endpoint", "--nproc-per-node", "--checkpoint", "--resume", "--shards",
             "--demo", "--strict"}  # aws, az, torchrun, examples, mkdocs
    wrong = []
    for page in PAGES:
        if page.name in ("reader.md", "CODE_MAP.md", "format.md"):
            continue
        for span in snippets.inline_code(page):
            m = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =]\S+)?", span)
            if m and m[1] not in every and m[1] not in other:
                wrong.append(f"{page.relative_to(ROOT)}: {m[1]}")
    assert not wrong, "\n".join(wrong)


def _imports(code: str) -> list[tuple[str, list[str]]]:
    tree = ast.parse(code)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def test_every_python_block_parses_and_its_shardio_imports_exist():
    wrong = []
    for b in (b for b in BLOCKS if b.kind == "python"):
        try:
            imports = _imports(b.code)
        except SyntaxError as e:
            wrong.append(f"{b.where}: does not parse: {e}")
            continue
        for module, names in imports:
            if module.split(".")[0] not in ("shardio", "preprocess"):
                if importlib.util.find_spec(module.split(".")[0]) is None:
                    wrong.append(f"{b.where}: no module {module}")
                continue
            if module == "shardio.train.lightning":  # imports Lightning: checked by its source, not imported
                source = (ROOT / "shardio" / "train" / "lightning.py").read_text(encoding="utf-8")
                wrong += [f"{b.where}: {module} has no {n}" for n in names if f"class {n}" not in source]
                continue
            mod = importlib.import_module(module)
            wrong += [f"{b.where}: {module} has no {n}" for n in names if not hasattr(mod, n)]
    assert not wrong, "\n".join(wrong)


def test_every_dotted_shardio_name_in_the_docs_resolves():
    """`shardio.read.order`, `shardio.train.augment.TrainAugment`: a renamed module or name fails here."""
    wrong = []
    for page in PAGES:
        if page.name == "CODE_MAP.md":
            continue
        for span in snippets.inline_code(page):
            for name in re.findall(r"\b((?:shardio|preprocess)(?:\.[A-Za-z_]\w*)+)\b", span):
                if not _resolves(name):
                    wrong.append(f"{page.relative_to(ROOT)}: `{name}`")
    assert not wrong, "names in the docs that do not exist:\n" + "\n".join(sorted(set(wrong)))


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        path = ROOT.joinpath(*parts[:cut])
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists() or list(
                path.parent.glob(f"{parts[cut - 1]}.*.so")) or path.with_suffix(".c").exists():
            rest = parts[cut:]
            if not rest:
                return True
            if module == "shardio.train.lightning" or not path.with_suffix(".py").exists() and not (
                    path / "__init__.py").exists():
                return True
            obj = importlib.import_module(module)
            for attr in rest:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def test_every_yaml_block_holds_known_config_keys():
    from preprocess.config import RESIZE_MODES, JobConfig

    keys = reference.documented_keys() | set(reference.BUCKET_KEYS)
    yaml_blocks = [b for b in BLOCKS if b.lang in ("yaml", "yml")]
    assert yaml_blocks
    for b in yaml_blocks:
        data = yaml.safe_load(b.code)
        assert isinstance(data, dict), b.where
        assert not set(data) - keys, f"{b.where}: keys JobConfig lacks: {sorted(set(data) - keys)}"
        if data.get("mode") != "bucket" or "bucket" in RESIZE_MODES:
            JobConfig(**data)  # a documented config is a valid one


def test_config_keys_named_in_inline_code_exist():
    keys = reference.documented_keys() | set(reference.BUCKET_KEYS)
    not_keys = {"note", "error", "pixels", "strict"}
    wrong = []
    for page in PAGES:
        for span in snippets.inline_code(page):
            m = re.fullmatch(r"([a-z_]+): (\S+)", span)
            if m and m[1] not in not_keys and m[1] not in keys:
                wrong.append(f"{page.relative_to(ROOT)}: `{span}`")
    assert not wrong, "config keys the code lacks:\n" + "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    wrong = []
    for target in snippets.links(page):
        if re.match(r"^[a-z]+:", target) or target.startswith("//"):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in snippets.anchors(dest):
            wrong.append(f"{target}: {dest.relative_to(ROOT)} has no heading #{anchor}")
    assert not wrong, f"{page.relative_to(ROOT)}: " + "; ".join(wrong)


def test_the_link_check_catches_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title here\n\n[a](p.md#title-here) [b](missing.md) [c](p.md#nope)\n", encoding="utf-8")
    assert snippets.links(page) == ["p.md#title-here", "missing.md", "p.md#nope"]
    assert snippets.anchors(page) == {"title-here"}


def test_the_generated_pages_and_the_readme_figures_are_up_to_date():
    assert not generate.stale(), f"out of date: {generate.stale()}; run `make docs-gen`"


def test_every_config_key_has_its_line_and_every_line_its_key():
    """The config reference is complete: a key added to JobConfig without a description fails here."""
    page = reference.config_page()
    for key, default in reference.config_keys().items():
        assert f"| `{key}` | `{reference.yaml_value(default)}` |" in page


def test_the_figures_come_from_the_bench_results(tmp_path):
    """Change a figure in the results and the README's table changes with it: nothing is copied by hand."""
    from docsgen import figures

    results = figures.load_results()
    name = figures.SUMMARY[0][0]
    for figure in results["figures"]:
        if figure["name"] == name:
            figure["value"] = 0.123
    assert "0.123x" in figures.readme_summary(results)
    assert "0.123x" in figures.figures_page(results)


def _docstring_ids(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of ``tree``'s module, classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _message_strings(path: Path) -> list[tuple[int, str]]:
    """String literals that are not docstrings (what can reach a user as a message)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstring_ids(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_error_messages_point_to_documentation_that_exists():
    wrong = []
    sources = [p for pkg in ("shardio", "preprocess") for p in (ROOT / pkg).rglob("*.py")]
    for path in sources:
        for line, text in _message_strings(path):
            for doc in re.findall(r"\b((?:docs|bench)/[\w./-]+\.md)", text):
                if not (ROOT / doc).exists():
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {doc} does not exist")
            if "README" in text and "bench/README" not in text:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: points to the README, which holds no detail: "
                             f"name a page under docs/")
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_an_unmarked_block_a_missing_option_and_a_missing_command(tmp_path):
    """The checks above can fail: a block without its marker, an option or command the CLI lacks."""
    page = tmp_path / "p.md"
    page.write_text("<!-- runs -->\n```bash\nshardio info d\n```\n\n```python\nimport shardio\n```\n\n"
                    "<!-- illustrative -->\n```bash\nRAY_AUTH_MODE=token .venv/bin/preprocess run 'a/*.tar' \\\n"
                    "    --output o --no-such-option 3\n```\n", encoding="utf-8")
    found = snippets.blocks(page)
    assert [(b.kind, b.marker) for b in found] == [("shell", "runs"), ("python", None), ("shell", "illustrative")]
    (call,) = [snippets.program_call(w) for w in snippets.commands(found[2].code)]
    assert call == ("preprocess", "run", ["--output", "--no-such-option"])
    assert "--no-such-option" not in OPTIONS["preprocess run"] and "--output" in OPTIONS["preprocess run"]
    assert "preprocess frobnicate" not in OPTIONS
    assert snippets.program_call(["python", "-m", "preprocess.cli", "gc", "d", "--retain-hours=0"]) == \
        ("preprocess", "gc", ["--retain-hours"])


# --- what a reader trips over: cut sentences, doubled words, a heading no message says, the wrong python ---

def _sentences_end(text: str) -> bool:
    """Whether ``text`` ends a sentence (``.``, ``!`` or ``?``, perhaps inside a closing bracket or quote)."""
    return re.search(r"[.!?][)\]'\"`]*$", text.strip()) is not None


def test_each_shipped_configs_description_is_whole_sentences():
    """The config reference describes each file in configs/ by its leading comment, never cut mid-sentence."""
    lines = [line for line in reference.config_page().splitlines() if line.startswith("- `configs/")]
    assert len(lines) == len(list((ROOT / "configs").glob("*.yaml")))
    cut = [line for line in lines if not _sentences_end(line)]
    assert not cut, f"descriptions cut mid-sentence: {cut}"


def _doubled(text: str) -> list[str]:
    """Phrases followed by themselves in parentheses (``run policy (run policy)``), as ``X (X)``."""
    found = []
    for m in re.finditer(r"\(([^()\n]{2,80})\)", text):
        inner = m.group(1).strip(" *_`")
        before = text[:m.start()].rstrip().rstrip("*_`;:,").rstrip()
        if inner and before.lower().endswith(inner.lower()):
            found.append(f"{inner} ({m.group(1)})")
    return found


def test_no_generated_page_says_a_phrase_twice_in_a_row():
    assert _doubled("a failed sample; run policy (run policy) |") == ["run policy (run policy)"]
    assert _doubled("the budget (a square) and more (see below)") == []
    doubled = {str(path.relative_to(ROOT)): _doubled(text) for path, text in generate.expected().items()}
    assert not any(doubled.values()), {page: found for page, found in doubled.items() if found}


def _message_words() -> set[str]:
    """Every word of a string the code can show a user: not a docstring, not a name in ``__all__``."""
    words: set[str] = set()
    for path in (p for pkg in ("shardio", "preprocess") for p in (ROOT / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstring_ids(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                skip.update(id(n) for n in ast.walk(node.value))
        words.update(w for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                     and id(n) not in skip for w in re.findall(r"\w+", n.value))
    return words


def _unsaid(quoted: str, said: set[str]) -> list[str]:
    """The words of a quoted message that no message says (placeholders in capitals and quoted values aside:
    ``OUTPUT``, ``HOST``, ``'cuda'``)."""
    plain = re.sub(r"'[^']*'|\"[^\"]*\"|\b[A-Z][A-Z_]*\b", " ", quoted)
    return [w for w in re.findall(r"[A-Za-z_]\w+", plain) if w not in said]


def test_every_troubleshooting_heading_quotes_words_a_message_says():
    """A user finds the entry by searching for what the error said: a heading that quotes a class name the
    message never prints (the CLI shows `error: ...`) cannot be found."""
    said = _message_words()
    assert _unsaid("UnsupportedStore", said) == ["UnsupportedStore"]  # a class name, in no message
    page = (ROOT / "docs/guides/troubleshooting.md").read_text(encoding="utf-8")
    section = page.split("## By message", 1)[1]
    headings = re.findall(r"\*\*`([^`]+)`\*\*", section)
    assert len(headings) >= 10
    unsaid = {quoted: words for quoted in headings if (words := _unsaid(quoted, said))}
    assert not unsaid, f"troubleshooting headings quoting words no message says: {unsaid}"


def test_a_command_running_the_repositorys_python_uses_its_environment():
    """The system python has no torch or numpy: an example or a module of this repository runs with
    `.venv/bin/python` (what `make install` builds) on the user-facing pages."""
    user_pages = [ROOT / "README.md", ROOT / "docs/quickstart.md",
                  *sorted((ROOT / "docs/guides").glob("*.md"))]
    bare = re.compile(r"(?<![\w/.])python3?\s+"
                      r"(?:examples/|bench/|-m\s+(?:bench|shardio|preprocess|docsgen)\b)")
    wrong = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in user_pages
             for m in bare.finditer(page.read_text(encoding="utf-8"))]
    assert not wrong, f"runs the repository's code with the system python: {wrong}"


def _ignored(name: str, patterns: list[str]) -> bool:
    """Whether .gitignore's ``patterns`` (as written: ``/out/``, ``*.so``) ignore the relative path
    ``name``."""
    for pattern in patterns:
        anchored = pattern.strip("/")
        if fnmatch.fnmatch(name, anchored) or name.startswith(anchored + "/") or (
                "/" not in pattern.rstrip("/") and fnmatch.fnmatch(name.rsplit("/", 1)[-1], anchored)):
            return True
    return False


def test_what_the_runnable_examples_write_in_the_checkout_is_ignored_by_git():
    """A reader who runs the README's examples in the checkout gets no stray file in `git status`: every file
    a runnable block saves at a relative path (`torch.save(..., "ckpt.pt")`, `--out`, `--report`) is
    ignored."""
    patterns = [line.strip() for line in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.startswith("#")]
    assert _ignored("out/sample-shards", patterns) and not _ignored("README.md", patterns)
    written = re.compile(r"""torch\.save\([^\n]*?,\s*["']([^"'/]+)["']\)"""
                         r"""|--(report|out)\s+([^\s/'"]+)(?=\s|$)""")
    stray = []
    for block in BLOCKS:
        if block.marker != snippets.RUNS:
            continue
        for m in written.finditer(block.code):
            if m.group(1):
                names = [m.group(1)]
            else:  # shardio preview --out NAME writes NAME.json beside it
                names = [m.group(3)] + ([m.group(3) + ".json"] if m.group(2) == "out" else [])
            stray += [f"{block.where}: {name}" for name in names if not _ignored(name, patterns)]
    assert not stray, f"files the runnable examples write that git would show: {stray}"
