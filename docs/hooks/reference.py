"""Reference pages written from the code itself, read with `ast` (nothing imported, so no torch).

Two sources: the config dataclasses of `rlhf/config.py` (every key, its type, its default and the
attribute docstring under it) and the Protocols of `rlhf/protocols.py` (each method's signature and
docstring). Both are rebuilt at every docs build, so they cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Field:
    """One config key as written in a dataclass body."""

    name: str
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Section:
    """One config dataclass placed at its dotted prefix (`learner.`, `reward.functions[].`)."""

    prefix: str
    cls: str
    doc: str
    fields: tuple[Field, ...]


def is_dataclass_def(node: ast.AST) -> bool:
    def name(d: ast.expr) -> str:
        return ast.unparse(d.func if isinstance(d, ast.Call) else d)

    return isinstance(node, ast.ClassDef) and any(name(d).endswith("dataclass") for d in node.decorator_list)


def type_text(node: ast.expr) -> str:
    """An annotation as a reader writes YAML for it: `Literal["a", "b"]` becomes `a | b`."""
    if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return " | ".join(str(ast.literal_eval(i)) for i in items)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return f"{type_text(node.left)} | {type_text(node.right)}"
    return ast.unparse(node)


def as_yaml(value: Any) -> Any:
    return [as_yaml(v) for v in value] if isinstance(value, (tuple, list)) else value


def default_text(node: ast.expr | None) -> str:
    """A default as YAML where it is a literal (`true`, `[jsonl]`, `1.0e-06`), else as Python."""
    if node is None:
        return "required"
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "field":
        factory = next((k.value for k in node.keywords if k.arg == "default_factory"), None)
        return f"{ast.unparse(factory)}()" if factory is not None else ast.unparse(node)
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)
    text = yaml.safe_dump(as_yaml(value), default_flow_style=True, width=10_000)
    return text.removesuffix("\n...\n").strip()


def docstring_after(stmt: ast.stmt | None) -> str:
    """The attribute docstring a statement is, or ""."""
    value = stmt.value if isinstance(stmt, ast.Expr) else None
    is_text = isinstance(value, ast.Constant) and isinstance(value.value, str)
    return inspect.cleandoc(value.value) if is_text else ""


def config_sections(source: Path, root: str = "RunConfig") -> list[Section]:
    """The dataclasses of `source` reachable from `root`, each at its dotted prefix, parents first."""
    classes = {n.name: n for n in ast.parse(source.read_text()).body if is_dataclass_def(n)}
    sections: list[Section] = []

    def visit(cls: str, prefix: str) -> None:
        node = classes[cls]
        fields, children = [], []
        for stmt, after in zip(node.body, [*node.body[1:], None]):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            name = stmt.target.id
            nested = [n.id for n in ast.walk(stmt.annotation) if isinstance(n, ast.Name) and n.id in classes]
            if nested and isinstance(stmt.annotation, ast.Name):  # a section of its own
                children.append((nested[0], f"{prefix}{name}."))
                continue
            if nested:  # a list of sections, e.g. tuple[RewardFnConfig, ...]
                children.append((nested[0], f"{prefix}{name}[]."))
            doc = docstring_after(after)
            fields.append(Field(name, type_text(stmt.annotation), default_text(stmt.value), doc))
        sections.append(Section(prefix, cls, inspect.cleandoc(ast.get_docstring(node) or ""), tuple(fields)))
        for child, child_prefix in children:
            visit(child, child_prefix)

    visit(root, "")
    return sections


def config_defaults(source: Path) -> dict[str, Any]:
    """Every dotted key's default as YAML reads it (`fsdp2`, `1`, `false`, `[jsonl]`)."""
    sections = config_sections(source)
    return {f"{s.prefix}{f.name}": yaml.safe_load(f.default) for s in sections for f in s.fields}


def prose(text: str) -> str:
    """A docstring as Markdown text: outside code spans, `|`, `*` and `<` are escaped, so that
    `<output_dir>` stays text and `[i*n:(i+1)*n]` is not emphasis; inside them nothing is."""
    def escape(part: str) -> str:
        return part.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")

    return "`".join(p if i % 2 else escape(p) for i, p in enumerate(text.split("`")))


def cell(text: str) -> str:
    """Text for one Markdown table cell: one line."""
    return prose(" ".join(text.split())) or "-"


def code(text: str) -> str:
    """One line in a code span (a table reads a `|` inside one as text)."""
    return f"`{' '.join(text.split())}`"


def config_reference(source: Path) -> str:
    """Markdown: one table per config section, one row per key."""
    out = []
    for s in config_sections(source):
        title = f"`{s.prefix.rstrip('.')}`" if s.prefix else "Top level"
        out += [f"### {title}", "", f"`{s.cls}`" + (f": {prose(s.doc)}" if s.doc else ""), ""]
        if s.prefix.endswith("[]."):
            out += [f"Each entry of the list `{s.prefix[:-3]}` takes these keys.", ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{s.prefix}{f.name}` | {code(f.type)} | {code(f.default)} | {cell(f.doc)} |"
                for f in s.fields]
        out.append("")
    return "\n".join(out)


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(fn.args).removeprefix("self").lstrip(", ")
    return f"{fn.name}({args})" + (f" -> {ast.unparse(fn.returns)}" if fn.returns else "")


def protocol_reference(source: Path) -> str:
    """Markdown: each Protocol class with its docstring, then its attributes and methods."""
    out = []
    for node in ast.parse(source.read_text()).body:
        if not (isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "Protocol" for b in node.bases)):
            continue
        out += [f"### `{node.name}`", "", prose(ast.get_docstring(node) or ""), ""]
        out += ["| member | what |", "|---|---|"]
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                out.append(f"| {code(f'{item.target.id}: {ast.unparse(item.annotation)}')} | attribute |")
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append(f"| {code(signature(item))} | {cell(ast.get_docstring(item) or '')} |")
        out.append("")
    return "\n".join(out)
