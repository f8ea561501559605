"""The rules of CEL in Kubernetes that no CEL library knows, checked on every expression of a
ValidatingAdmissionPolicy (tests/deploy/test_cel_kubernetes_rules.py).

A CEL library accepts ``object.metadata.namespace``: ``namespace`` is a reserved word, but the
CEL grammar lets a reserved word be a field name. Kubernetes does not always: where it types an
object from its OpenAPI schema it renames every property whose name is a reserved word
(``__namespace__``) or holds ``.``, ``-`` or ``/`` (``__dot__``, ``__dash__``, ``__slash__``),
so a selection of the plain name does not compile ("undefined field 'namespace'", before 1.32),
while in an admission policy ``object``, ``oldObject`` and ``params`` are untyped maps at run
time, where only the plain name exists. The one spelling that works in both is none: avoid such
field names (``request.namespace`` is a field of the typed request, declared by that name;
index syntax, ``x['namespace']``, reads a map in both). The same holds for ``has()``, which
tests a field; on a map of free keys (labels, annotations, a ConfigMap's data, a token's
extras) a key is tested with ``in``. ``request`` is typed: only its declared fields compile.

:func:`violations` walks the parse tree (cel-python's) of each expression, with the types of
``object``/``oldObject`` taken from the Kubernetes 1.30 OpenAPI schemas (Pod and Event: the
policies match pods, their subresources and Events) and those of the policy's variables
inferred from their own expressions, and reports every breach with where it is. What
``object`` and ``oldObject`` are on a DELETE or a CREATE (null) is a matter of evaluation, not
of the parse tree: the tests evaluate every expression on every kind of request."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
from lark import Token, Tree

#: CEL's reserved words (the language definition's RESERVED, and its keywords): never a field
#: name in an expression here.
RESERVED = frozenset(
    {
        "as",
        "break",
        "const",
        "continue",
        "else",
        "for",
        "function",
        "if",
        "import",
        "let",
        "loop",
        "package",
        "namespace",
        "return",
        "var",
        "void",
        "while",
        "in",
        "true",
        "false",
        "null",
    }
)
#: Kubernetes' escapes of property names (apiserver/pkg/cel/escaping.go): a reserved word as
#: ``__namespace__``; ``.``, ``-``, ``/`` and ``__`` within a name as ``__dot__``, ``__dash__``,
#: ``__slash__``, ``__underscores__`` (``ray.io/serve``: ``ray__dot__io__slash__serve``).
ESCAPED = re.compile(r"__(dot|dash|slash|underscores)__|^__\w+__$")

SCHEMAS = (
    Path(kubernetes_validate.__file__).parent
    / "kubernetes-json-schema"
    / "v1.30.0-local"
    / "_definitions.json"
)


# -- types ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dyn:
    """Unknown: no rule that needs a type applies."""


@dataclass(frozen=True)
class Obj:
    """An object of one of these OpenAPI schemas (properties), a union for object/oldObject."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class Map:
    """A map of free keys (additionalProperties; labels, annotations, data, extras)."""

    value: Any


@dataclass(frozen=True)
class List:
    element: Any


@dataclass(frozen=True)
class Typed:
    """A type the API server declares natively, with its fields (the request)."""

    name: str
    fields: dict[str, Any] = field(hash=False, compare=False)


@dataclass(frozen=True)
class Variables:
    defined: tuple[str, ...]


GVR = Typed("GroupVersionResource", {"group": Dyn(), "version": Dyn(), "resource": Dyn()})
GVK = Typed("GroupVersionKind", {"group": Dyn(), "version": Dyn(), "kind": Dyn()})
# k8s.io/apiserver/pkg/admission/plugin/cel: BuildRequestType.
REQUEST = Typed(
    "kubernetes.AdmissionRequest",
    {
        "kind": GVK,
        "resource": GVR,
        "subResource": Dyn(),
        "requestKind": GVK,
        "requestResource": GVR,
        "requestSubResource": Dyn(),
        "name": Dyn(),
        "namespace": Dyn(),
        "operation": Dyn(),
        "userInfo": Typed(
            "kubernetes.UserInfo",
            {
                "username": Dyn(),
                "uid": Dyn(),
                "groups": List(Dyn()),
                "extra": Map(List(Dyn())),
            },
        ),
        "dryRun": Dyn(),
        "options": Dyn(),
    },
)
POD, EVENT, NAMESPACE = (
    "io.k8s.api.core.v1.Pod",
    "io.k8s.api.core.v1.Event",
    ("io.k8s.api.core.v1.Namespace"),
)


@functools.cache
def definitions() -> dict[str, Any]:
    return json.loads(SCHEMAS.read_text())["$defs"]


def _resolve(schema: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    ref = schema.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[1]
        return name, definitions()[name]
    return None, schema


def type_of_schema(schema: dict[str, Any]) -> Any:
    name, schema = _resolve(schema)
    if "properties" in schema and name is not None:
        return Obj((name,))
    if "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        return Map(type_of_schema(schema["additionalProperties"]))
    if "items" in schema:
        return List(type_of_schema(schema["items"]))
    return Dyn()


def properties(obj: Obj) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name in obj.names:
        for key, schema in definitions()[name].get("properties", {}).items():
            found.setdefault(key, schema)
    return found


# -- the walk ---------------------------------------------------------------------------

WRAPPERS = {
    "expr",
    "conditionalor",
    "conditionaland",
    "relation",
    "addition",
    "multiplication",
    "unary",
    "member",
    "primary",
}
MACROS = {"all", "exists", "exists_one", "filter", "map"}


@dataclass
class Walk:
    where: str
    scope: dict[str, Any]
    found: list[str] = field(default_factory=list)

    def flag(self, message: str) -> None:
        self.found.append(f"{self.where}: {message}")

    # Single-child wrapper nodes of the grammar carry nothing.
    @staticmethod
    def unwrap(node: Any) -> Any:
        while isinstance(node, Tree) and node.data in WRAPPERS and len(node.children) == 1:
            node = node.children[0]
        return node

    def visit(self, node: Any) -> Any:
        node = self.unwrap(node)
        if isinstance(node, Token):
            return Dyn()
        kind = node.data
        if kind == "expr" and len(node.children) == 3:  # c ? a : b
            self.visit(node.children[0])
            branches = [self.visit(node.children[1]), self.visit(node.children[2])]
            typed = [t for t in branches if not isinstance(t, Dyn)]
            return typed[0] if typed else Dyn()
        if kind == "ident":
            return self.ident(str(node.children[0]))
        if kind == "ident_arg":
            return self.call(str(node.children[0]), self.args(node, 1))
        if kind == "member_dot":
            return self.select(self.visit(node.children[0]), str(node.children[1]))
        if kind == "member_dot_arg":
            return self.method(node.children[0], str(node.children[1]), self.args(node, 2))
        if kind == "member_index":
            return self.index(self.visit(node.children[0]), node.children[1])
        if kind == "paren_expr":
            return self.visit(node.children[0])
        if kind in {"map_lit", "list_lit"}:
            for child in node.children:
                self.visit(child)
            return Map(Dyn()) if kind == "map_lit" else List(Dyn())
        if kind in {"dot_ident", "dot_ident_arg"}:
            self.flag(f"a leading-dot name .{node.children[0]}")
            return Dyn()
        for child in node.children:
            self.visit(child)
        return Dyn()

    @staticmethod
    def args(node: Tree, at: int) -> list[Any]:
        if len(node.children) <= at:
            return []
        exprlist = node.children[at]
        return list(exprlist.children) if isinstance(exprlist, Tree) else []

    def ident(self, name: str) -> Any:
        if name in self.scope:
            return self.scope[name]
        self.flag(f"{name} is not declared in a policy's environment")
        return Dyn()

    def call(self, name: str, args: list[Any]) -> Any:
        if name == "has":
            (arg,) = args
            target = self.unwrap(arg)
            if not (isinstance(target, Tree) and target.data == "member_dot"):
                self.flag("has() of something other than a field selection")
                return Dyn()
            self.field(self.visit(target.children[0]), str(target.children[1]), in_has=True)
            return Dyn()
        types = [self.visit(arg) for arg in args]
        if name == "dyn" and len(types) == 1:
            return types[0]
        return Dyn()

    def method(self, receiver: Any, name: str, args: list[Any]) -> Any:
        target = self.visit(receiver)
        if name in MACROS and len(args) in (2, 3):
            variable = self.unwrap(args[0])
            bound = str(variable.children[0]) if isinstance(variable, Tree) else "?"
            element: Any = Dyn()
            if isinstance(target, List):
                element = target.element
            inner = Walk(self.where, {**self.scope, bound: element}, self.found)
            for arg in args[1:]:
                inner.visit(arg)
            if name == "filter" and isinstance(target, List):
                return target
            if name == "filter" and isinstance(target, Map | Obj):
                return List(Dyn())
            return Dyn()
        for arg in args:
            self.visit(arg)
        return Dyn()

    def select(self, target: Any, name: str) -> Any:
        return self.field(target, name, in_has=False)

    def field(self, target: Any, name: str, *, in_has: bool) -> Any:
        what = f"has(...{name})" if in_has else f".{name}"
        if isinstance(target, Typed):
            if name not in target.fields:
                self.flag(f"{what}: {target.name} has no field {name}")
                return Dyn()
            return target.fields[name]
        if isinstance(target, Variables):
            if name not in target.defined:
                self.flag(f"variables.{name} is not defined before this expression")
            return self.scope.get(f"variables.{name}", Dyn())
        if name in RESERVED:
            self.flag(
                f"{what}: {name} is a CEL reserved word; Kubernetes types it {name} in an "
                f"untyped map and __{name}__ in a schema-typed object: avoid it (request."
                f"namespace is the typed request's own field; x['{name}'] reads a map)"
            )
            return Dyn()
        if ESCAPED.search(name):
            self.flag(
                f"{what}: an escaped property name works only where Kubernetes types the "
                "object from its schema; object, oldObject and params are untyped in an "
                "admission policy"
            )
            return Dyn()
        if isinstance(target, Map):
            if in_has:
                self.flag(f"{what}: has() on a key of a map of free keys: use '{name}' in it")
            return target.value
        if isinstance(target, Obj):
            props = properties(target)
            if name not in props:
                self.flag(f"{what}: {'/'.join(target.names)} has no property {name}")
                return Dyn()
            return type_of_schema(props[name])
        if isinstance(target, List):
            self.flag(f"{what}: a field of a list")
        return Dyn()

    def index(self, target: Any, key_node: Any) -> Any:
        key = self.unwrap(key_node)
        literal = None
        if isinstance(key, Tree) and key.data == "literal":
            token = str(key.children[0])
            if token[:1] in {"'", '"'}:
                literal = token[1:-1]
        else:
            self.visit(key_node)
        if isinstance(target, Typed):
            self.flag(f"[...] on the typed {target.name}: select its fields")
            return Dyn()
        if isinstance(target, Map):
            return target.value
        if isinstance(target, List):
            return target.element
        if isinstance(target, Obj) and literal is not None:
            if ESCAPED.search(literal):
                self.flag(f"['{literal}']: an escaped property name (see .{literal})")
                return Dyn()
            props = properties(target)
            if literal not in props:
                self.flag(f"['{literal}']: {'/'.join(target.names)} has no property {literal}")
                return Dyn()
            return type_of_schema(props[literal])
        return Dyn()


def expressions(policy: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expression) of every CEL expression of a policy, in the order the API server
    evaluates them: match conditions, variables, validations with their messages."""
    spec = policy["spec"]
    found = [
        (f"matchConditions[{c['name']}]", c["expression"]) for c in spec.get("matchConditions", [])
    ]
    found += [(f"variables[{v['name']}]", v["expression"]) for v in spec.get("variables", [])]
    for i, validation in enumerate(spec.get("validations", [])):
        found.append((f"validations[{i}].expression", validation["expression"]))
        if "messageExpression" in validation:
            found.append((f"validations[{i}].messageExpression", validation["messageExpression"]))
    for i, annotation in enumerate(spec.get("auditAnnotations", [])):
        found.append((f"auditAnnotations[{i}].valueExpression", annotation["valueExpression"]))
    return found


def root_scope(policy: dict[str, Any]) -> dict[str, Any]:
    pod_or_event = Obj((POD, EVENT))
    scope: dict[str, Any] = {
        "request": REQUEST,
        "object": pod_or_event,
        "oldObject": pod_or_event,
        "namespaceObject": Obj((NAMESPACE,)),
        "authorizer": Dyn(),
    }
    if policy["spec"].get("paramKind"):
        scope["params"] = Dyn()
    return scope


def violations(policy: dict[str, Any]) -> list[str]:
    """Every breach of the rules above, in every expression of ``policy``."""
    env = celpy.Environment()
    scope = root_scope(policy)
    found: list[str] = []
    defined: list[str] = []
    match_scope = dict(scope)  # match conditions see no variables
    for where, text in expressions(policy):
        try:
            tree = env.compile(text)
        except celpy.CELParseError as error:
            found.append(f"{where}: does not parse: {error}")
            continue
        if where.startswith("matchConditions"):
            Walk(where, match_scope, found).visit(tree)
            continue
        local = {**scope, "variables": Variables(tuple(defined))}
        local.update({k: v for k, v in scope.items() if k.startswith("variables.")})
        result = Walk(where, local, found).visit(tree)
        if where.startswith("variables["):
            name = where[len("variables[") : -1]
            scope[f"variables.{name}"] = result
            defined.append(name)
    return found


def check_expression(expression: str, policy_spec: dict[str, Any] | None = None) -> list[str]:
    """The violations of one validation expression in an otherwise empty policy (for the
    walker's own tests)."""
    spec = {"validations": [{"expression": expression}], **(policy_spec or {})}
    return violations({"spec": spec})
