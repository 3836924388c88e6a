"""psrl/_kvx.pyi against the built module: the names, parameters and defaults mypy checks callers with are
the ones csrc/bindings.cpp binds (pybind11 writes each signature as the first line of its docstring)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import psrl
from psrl import _kvx

STUB = ast.parse((Path(psrl.__file__).parent / "_kvx.pyi").read_text())


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "[("
        depth -= char in "])"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in [*parts, text[start:]] if p.strip()]


def _runtime_params(obj: object) -> list[tuple[str, bool]]:
    """(name, has a default) of each parameter in a pybind11 signature line, without self."""
    doc = (getattr(obj, "__doc__", None) or "").splitlines()[0]
    inside = doc[doc.index("(") + 1 : doc.rindex(") ->")]
    params = [(p.split(":")[0].strip(), "=" in p) for p in _split_top_level(inside)]
    return [p for p in params if p[0] != "self"]


def _stub_params(node: ast.FunctionDef) -> list[tuple[str, bool]]:
    args = [a for a in node.args.args if a.arg != "self"]
    first_default = len(args) - len(node.args.defaults)
    return [(a.arg, i >= first_default) for i, a in enumerate(args)]


def _public(body: list[ast.stmt]) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


STUB_FUNCTIONS = _public(STUB.body)
STUB_CLASSES = {n.name: n for n in STUB.body if isinstance(n, ast.ClassDef)}


def _runtime(name: str) -> object:
    if not hasattr(_kvx, name):
        assert not _kvx.HAS_CUDA, f"psrl._kvx has no {name}"
        pytest.skip(f"{name} exists in CUDA builds only")
    return getattr(_kvx, name)


@pytest.mark.parametrize("name", sorted(STUB_FUNCTIONS))
def test_stub_functions_match_the_bindings(name: str) -> None:
    assert _stub_params(STUB_FUNCTIONS[name]) == _runtime_params(_runtime(name))


def test_every_binding_is_in_the_stub() -> None:
    bound = {name for name in vars(_kvx) if not name.startswith("_")} - {"HAS_CUDA", "NcclUnavailableError"}
    assert bound <= set(STUB_FUNCTIONS) | set(STUB_CLASSES)


@pytest.mark.parametrize("name", sorted(set(STUB_CLASSES) - {"NcclUnavailableError"}))
def test_stub_classes_match_the_bindings(name: str) -> None:
    cls = _runtime(name)
    node = STUB_CLASSES[name]
    members = {n for n in vars(cls) if not n.startswith("_")}
    assert set(_public(node.body)) == members
    for method_name, method in _public(node.body).items():
        if not any(isinstance(d, ast.Name) and d.id == "property" for d in method.decorator_list):
            assert _stub_params(method) == _runtime_params(getattr(cls, method_name)), method_name
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None:
        assert _stub_params(init) == _runtime_params(cls.__init__)
