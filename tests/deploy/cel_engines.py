"""Two independent CEL implementations behind one small interface, for the tests of deploy/'s
ValidatingAdmissionPolicies: cel-python (``celpy``, a pure-Python interpreter) and Google's C++
implementation (cel-cpp, through its Python binding ``cel-expr-python``). Every expression of
the policies is compiled and evaluated by both, and the tests require the same answers, so
that a quirk of one library cannot make a broken policy pass.

As in the API server's admission environment, ``object``, ``oldObject`` and ``params`` are
untyped (dyn) and ``params`` is declared only when the policy has a ``paramKind`` (referring to
it otherwise does not compile, there as here: cel-cpp type-checks against the declarations;
cel-python fails when it evaluates the name). An expression that fails to evaluate gives a
:class:`CelError`, which the callers count as ``failurePolicy: Fail`` makes the API server count
it."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any, Protocol

import celpy
from cel_expr_python import cel as cpp
from celpy import celtypes

#: The names the admission environment declares for every policy (authorizer left out: no
#: policy here uses it); ``params`` only with a paramKind.
DECLARED = ("request", "object", "oldObject", "namespaceObject", "variables")


class CompileError(Exception):
    """An expression that does not compile (the API server refuses such a policy)."""


@dataclass(frozen=True)
class CelError:
    """An evaluation error (a value, not an exception: CEL's errors are values)."""

    message: str


class Engine(Protocol):
    name: str

    def compile(self, expression: str) -> Any: ...

    def evaluate(self, program: Any, data: dict[str, Any]) -> Any: ...


def _plain(value: Any) -> Any:
    """A cel-python result as plain Python (bool before int: BoolType is an int)."""
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    if isinstance(value, celtypes.StringType):
        return str(value)
    if isinstance(value, celtypes.IntType | celtypes.UintType):
        return int(value)
    if isinstance(value, celtypes.DoubleType):
        return float(value)
    if isinstance(value, celtypes.MapType):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, celtypes.ListType):
        return [_plain(v) for v in value]
    return value


class CelPython:
    """cel-python: parses with lark, evaluates in Python."""

    name = f"cel-python {importlib.metadata.version('cel-python')}"

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.env = celpy.Environment()

    def compile(self, expression: str) -> Any:
        try:
            return self.env.program(self.env.compile(expression))
        except celpy.CELParseError as error:
            raise CompileError(f"{self.name}: {error}") from error

    def evaluate(self, program: Any, data: dict[str, Any]) -> Any:
        activation = {
            name: celpy.json_to_cel(value) for name, value in data.items() if name in self.names
        }
        try:
            result = program.evaluate(activation)
        except celpy.CELEvalError as error:
            return CelError(f"{self.name}: {error}")
        if isinstance(result, celpy.CELEvalError):
            return CelError(f"{self.name}: {result}")
        return _plain(result)


class CelCpp:
    """Google's C++ implementation (cel-expr-python): parses, type-checks against the declared
    names (all dyn, as the API server declares object, oldObject and params), evaluates."""

    name = f"cel-expr-python {importlib.metadata.version('cel-expr-python')} (cel-cpp)"

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.env = cpp.NewEnv(variables=dict.fromkeys(names, cpp.Type.DYN))

    def compile(self, expression: str) -> Any:
        try:
            return self.env.compile(expression)
        except RuntimeError as error:
            raise CompileError(f"{self.name}: {error}") from error

    def evaluate(self, program: Any, data: dict[str, Any]) -> Any:
        result = program.eval(data={k: v for k, v in data.items() if k in self.names})
        if result.type() == cpp.Type.ERROR:
            return CelError(f"{self.name}: {result.value()}")
        return result.plain_value()


def engines(names: tuple[str, ...] = DECLARED) -> list[Engine]:
    """Both implementations, for an environment that declares ``names``."""
    return [CelPython(names), CelCpp(names)]
