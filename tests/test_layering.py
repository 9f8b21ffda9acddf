"""No module of the service imports another module's private names.

A name with one leading underscore is its module's own business: a module that needs it from
elsewhere makes the owner publish it. A private module (``pkg/_impl.py``) is its package's
business: only modules inside ``pkg`` may import it. The import graph's other rules (layers, no
cycles) are `lint-imports` contracts in pyproject.toml; this one needs the imported names, which
the graph does not keep, so it reads the sources with ``ast``. Imports inside functions and under
``TYPE_CHECKING`` count like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("learner", "rollout_server", "rewards", "grpo_common")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    """Every module of the four packages, by dotted name."""
    return {
        module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


def within(importer: str, package: str) -> bool:
    return importer == package or importer.startswith(package + ".")


def private_module_offence(importer: str, module: str) -> str | None:
    """Why ``importer`` may not import ``module``, if a private part of its path is not the
    importer's own package's."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if is_private(part) and not within(importer, ".".join(parts[:i])):
            return f"private module {'.'.join(parts[: i + 1])}"
    return None


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of a ``from ... import``, relative forms resolved."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def offences(
    importer: str, is_package: bool, tree: ast.AST, modules: set[str]
) -> Iterator[tuple[int, str, str]]:
    """``(line, import, why)`` for each import in ``tree`` of another module's private name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES and (
                    why := private_module_offence(importer, alias.name)
                ):
                    yield node.lineno, f"import {alias.name}", why
        elif isinstance(node, ast.ImportFrom):
            module = resolve(importer, is_package, node)
            if module.split(".")[0] not in PACKAGES:
                continue
            if why := private_module_offence(importer, module):
                names = ", ".join(a.name for a in node.names)
                yield node.lineno, f"from {module} import {names}", why
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in modules:  # a submodule, imported by name
                    why = private_module_offence(importer, sub)
                elif is_private(alias.name) and module != importer:
                    why = f"private name of {module}"
                else:
                    why = None
                if why:
                    yield node.lineno, f"from {module} import {alias.name}", why


def test_no_module_imports_another_modules_private_names() -> None:
    modules = source_modules()
    found = [
        f"{path.relative_to(ROOT)}:{line}: {code} ({why})"
        for name, path in sorted(modules.items())
        for line, code, why in offences(
            name, path.name == "__init__.py", ast.parse(path.read_text()), set(modules)
        )
    ]
    assert not found, (
        f"{len(found)} import(s) of private names across modules; make the name public in its "
        f"module (or the module public in its package) if it is shared:\n" + "\n".join(found)
    )


def test_the_check_sees_what_it_must() -> None:
    """The rule on made-up imports, so an empty offender list means clean code, not a blind
    check."""
    modules = {"rewards.a", "rewards.pkg", "rewards.pkg._impl", "rewards.pkg.b"}

    def check(importer: str, code: str) -> list[str]:
        is_package = importer == "rewards.pkg"
        return [why for _, _, why in offences(importer, is_package, ast.parse(code), modules)]

    assert check("rewards.b", "from rewards.a import _helper") == ["private name of rewards.a"]
    assert check("rewards.b", "def f():\n    from rewards.a import _helper") == [
        "private name of rewards.a"
    ]
    assert check("rewards.b", "from rewards.a import helper, __version__") == []
    assert check("rewards.b", "from torch import _C") == []  # only the service's own modules
    assert check("rewards.pkg.b", "from rewards.pkg._impl import x") == []
    assert check("rewards.pkg.b", "from . import _impl") == []
    assert check("rewards.pkg", "from ._impl import x") == []
    assert check("rewards.a", "from rewards.pkg._impl import x") == [
        "private module rewards.pkg._impl"
    ]
    assert check("rewards.a", "from rewards.pkg import _impl") == [
        "private module rewards.pkg._impl"
    ]
    assert check("rewards.a", "import rewards.pkg._impl") == ["private module rewards.pkg._impl"]
    assert check("rewards.pkg.b", "from .._x import y") == []  # rewards._x is rewards' own
    assert check("rewards.pkg.b", "from ..a import _h") == ["private name of rewards.a"]


def test_test_modules_have_unique_basenames() -> None:
    """The test folders have no ``__init__.py``: pytest imports each test module by its
    basename, and refuses to collect a second module of the same name in one run."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "conftest.py":
            continue
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, "rename one of each pair: " + "; ".join(clashes)
