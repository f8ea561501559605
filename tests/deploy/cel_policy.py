"""Evaluating a ValidatingAdmissionPolicy's CEL as the API server would, with cel-python
(``celpy``), and editing sample pods, for the tests of deploy/'s admission policies
(test_admission_policy.py: the aggregator's; test_agent_admission_policy.py: the agents').

The policies use standard CEL only, so the same expressions give the same answers here and in
the API server, which evaluates ``object``, ``oldObject`` and ``params`` as untyped maps, as
here. An expression that fails to evaluate counts as a refusal, as ``failurePolicy: Fail``
makes it."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

import celpy
from celpy import celtypes

from tests.deploy.manifests import SETTINGS, find, render


@dataclass
class Verdict:
    matched: bool
    #: The messages of the validations that failed (or errors): empty means admitted.
    refusals: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.refusals


class Policy:
    """The policy's CEL, compiled once; ``admit`` answers one request as the API server would
    for a binding with ``validationActions: [Deny]``."""

    def __init__(self, policy: dict[str, Any]) -> None:
        self.env = celpy.Environment()
        spec = policy["spec"]
        self.match = [self._compile(c["expression"]) for c in spec.get("matchConditions", [])]
        self.variables = [(v["name"], self._compile(v["expression"])) for v in spec["variables"]]
        self.validations = [
            (
                self._compile(v["expression"]),
                self._compile(v["messageExpression"]) if "messageExpression" in v else None,
                v.get("message", ""),
            )
            for v in spec["validations"]
        ]

    def _compile(self, expression: str) -> Any:
        return self.env.program(self.env.compile(expression))

    @staticmethod
    def _run(program: Any, activation: dict[str, Any]) -> Any:
        try:
            result = program.evaluate(activation)
        except celpy.CELEvalError as error:
            return error
        return result

    def admit(
        self,
        request: dict[str, Any],
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
        params: dict[str, Any],
    ) -> Verdict:
        activation: dict[str, Any] = {
            "request": celpy.json_to_cel(request),
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old),
            "params": celpy.json_to_cel(params),
        }
        for program in self.match:
            result = self._run(program, activation)
            if isinstance(result, celpy.CELEvalError):
                return Verdict(True, [f"match condition error: {result}"])  # failurePolicy Fail
            if result is not celtypes.BoolType(True) and not result:
                return Verdict(False)
        variables: dict[Any, Any] = {}
        activation["variables"] = celtypes.MapType(variables)
        for name, program in self.variables:
            variables[celtypes.StringType(name)] = self._run(program, activation)
            activation["variables"] = celtypes.MapType(variables)
        verdict = Verdict(True)
        for expression, message_expression, message in self.validations:
            result = self._run(expression, activation)
            if isinstance(result, celpy.CELEvalError):
                verdict.refusals.append(f"error: {result}")
            elif not result:
                text = message
                if message_expression is not None:
                    rendered = self._run(message_expression, activation)
                    assert isinstance(rendered, str), f"messageExpression failed: {rendered}"
                    text = str(rendered)
                verdict.refusals.append(text)
        return verdict


# -- editing sample pods ----------------------------------------------------------------


def changed(
    obj: dict[str, Any], edit: Any, manager: str = "serve-health-aggregator"
) -> dict[str, Any]:
    """A copy of ``obj`` after ``edit`` (which changes it in place), with what the API server
    itself changes on every write (managedFields, for the writer ``manager``)."""
    new = copy.deepcopy(obj)
    edit(new)
    new["metadata"]["managedFields"] = [
        *new["metadata"]["managedFields"],
        {"manager": manager, "operation": "Update"},
    ]
    return new


def set_label(key: str, value: str | None) -> Any:
    def edit(obj: dict[str, Any]) -> None:
        if value is None:
            obj["metadata"]["labels"].pop(key, None)
        else:
            obj["metadata"]["labels"][key] = value

    return edit


def set_condition(kind: str, status: str | None, reason: str = "Probed") -> Any:
    def edit(obj: dict[str, Any]) -> None:
        conditions = [c for c in obj["status"]["conditions"] if c["type"] != kind]
        if status is not None:
            conditions.append({"type": kind, "status": status, "reason": reason})
        obj["status"]["conditions"] = conditions

    return edit


def all_of(*edits: Any) -> Any:
    def edit(obj: dict[str, Any]) -> None:
        for one in edits:
            one(obj)

    return edit


def set_path(*path: str, value: Any) -> Any:
    def edit(obj: dict[str, Any]) -> None:
        target = obj
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value

    return edit


def set_image(obj: dict[str, Any]) -> None:
    obj["spec"]["containers"][0]["image"] = "attacker/miner:latest"


@functools.cache
def rendered_policy(
    directory: str, name: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(policy ``name``, its binding, the settings ConfigMap) as ``directory`` renders them."""
    objects = render(directory)
    return (
        find(objects, "ValidatingAdmissionPolicy", name),
        find(objects, "ValidatingAdmissionPolicyBinding", name),
        find(objects, "ConfigMap", SETTINGS),
    )
