"""Evaluating a ValidatingAdmissionPolicy's CEL as the API server would, with two independent
CEL implementations (tests/deploy/cel_engines.py: cel-python and Google's cel-cpp), and editing
sample pods, for the tests of deploy/'s admission policies (test_admission_policy.py: the
aggregator's; test_agent_admission_policy.py: the agents'; test_admission_policy_isolation.py:
what they do to everyone else's requests).

Every request is answered by both implementations, and :meth:`Policy.admit` fails the test if
they disagree: a quirk of one cannot make a broken policy pass. As in the API server, the match
conditions come first (any false: not matched; else any error: refused, ``failurePolicy:
Fail``), then the variables in order (lazily in the API server: a variable that fails counts
where it is used), then every validation, with its messageExpression when it fails. ``params``
is declared, and bound, only for a policy with a ``paramKind``."""

from __future__ import annotations

import atexit
import copy
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.cel_engines import DECLARED, CelError, Engine, engines
from tests.deploy.manifests import (
    ROOT,
    SETTINGS,
    find,
    render,
    render_written,
    settings_configmap,
)


@dataclass
class Verdict:
    matched: bool
    #: The messages of the validations that failed (or errors): empty means admitted.
    refusals: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.refusals

    def comparable(self) -> tuple[bool, list[str]]:
        """The verdict without the implementations' own error texts."""
        return self.matched, [
            r.split(": ", 2)[1] if r.startswith("error: ") else r for r in self.refusals
        ]


def _short(error: CelError) -> str:
    return error.message[:400]


class _Compiled:
    """One policy compiled by one implementation."""

    def __init__(self, engine: Engine, spec: dict[str, Any]) -> None:
        self.engine = engine
        self.match = [
            (c["name"], engine.compile(c["expression"])) for c in spec.get("matchConditions", [])
        ]
        self.variables = [
            (v["name"], engine.compile(v["expression"])) for v in spec.get("variables", [])
        ]
        self.validations = [
            (
                engine.compile(v["expression"]),
                engine.compile(v["messageExpression"]) if "messageExpression" in v else None,
                v.get("message", ""),
            )
            for v in spec["validations"]
        ]

    def conditions(self, data: dict[str, Any]) -> list[Any]:
        return [self.engine.evaluate(program, data) for _, program in self.match]

    def admit(self, data: dict[str, Any]) -> Verdict:
        results = self.conditions(data)
        if any(result is False for result in results):
            return Verdict(False)
        errors = [
            f"error: matchConditions[{name}]: {_short(r) if isinstance(r, CelError) else r!r}"
            for (name, _), r in zip(self.match, results, strict=True)
            if r is not True
        ]
        if errors:
            return Verdict(True, errors)
        variables: dict[str, Any] = {}
        data = {**data, "variables": variables}
        for name, program in self.variables:
            value = self.engine.evaluate(program, data)
            if not isinstance(value, CelError):  # left out: its users fail, as in the API server
                variables[name] = value
        verdict = Verdict(True)
        for i, (expression, message_expression, message) in enumerate(self.validations):
            result = self.engine.evaluate(expression, data)
            if isinstance(result, CelError) or not isinstance(result, bool):
                verdict.refusals.append(f"error: validations[{i}]: {result}")
            elif not result:
                text = message
                if message_expression is not None:
                    rendered = self.engine.evaluate(message_expression, data)
                    assert isinstance(rendered, str), (
                        f"{self.engine.name}: messageExpression {i} failed: {rendered}"
                    )
                    text = rendered
                verdict.refusals.append(text)
        return verdict


class Policy:
    """The policy's CEL, compiled once by both implementations; ``admit`` answers one request
    as the API server would for a binding with ``validationActions: [Deny]``."""

    def __init__(self, policy: dict[str, Any]) -> None:
        spec = policy["spec"]
        self.has_params = bool(spec.get("paramKind"))
        names = DECLARED + (("params",) if self.has_params else ())
        self.compiled = [_Compiled(engine, spec) for engine in engines(names)]

    @staticmethod
    def data(
        request: dict[str, Any],
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
        params: dict[str, Any] | None,
    ) -> dict[str, Any]:
        namespace = request.get("namespace") or ""
        return {
            "request": request,
            "object": obj,
            "oldObject": old,
            "namespaceObject": (
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
                if namespace
                else None
            ),
            "params": params,
        }

    def conditions(
        self,
        request: dict[str, Any],
        obj: dict[str, Any] | None = None,
        old: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> list[list[Any]]:
        """What each match condition gives, per implementation (values or CelError)."""
        data = self.data(request, obj, old, params)
        return [compiled.conditions(data) for compiled in self.compiled]

    def errors(
        self,
        request: dict[str, Any],
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
        params: dict[str, Any] | None = None,
    ) -> list[str]:
        """Every expression that fails to evaluate on this request, in either implementation:
        the match conditions; if they all hold, every variable, every validation and every
        messageExpression (whether or not its validation fails)."""
        data = self.data(request, obj, old, params)
        found: list[str] = []
        for compiled in self.compiled:
            name = compiled.engine.name
            results = compiled.conditions(data)
            found += [
                f"{name}: matchConditions[{c}]: {r}"
                for (c, _), r in zip(compiled.match, results, strict=True)
                if not isinstance(r, bool)
            ]
            if not all(r is True for r in results):
                continue
            variables: dict[str, Any] = {}
            scope = {**data, "variables": variables}
            for variable, program in compiled.variables:
                value = compiled.engine.evaluate(program, scope)
                if isinstance(value, CelError):
                    found.append(f"{name}: variables[{variable}]: {_short(value)}")
                else:
                    variables[variable] = value
            for i, (expression, message_expression, _) in enumerate(compiled.validations):
                result = compiled.engine.evaluate(expression, scope)
                if not isinstance(result, bool):
                    found.append(f"{name}: validations[{i}]: {result}")
                if message_expression is not None:
                    text = compiled.engine.evaluate(message_expression, scope)
                    if not isinstance(text, str):
                        found.append(f"{name}: validations[{i}].messageExpression: {text}")
        return found

    def admit(
        self,
        request: dict[str, Any],
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
        params: dict[str, Any] | None = None,
    ) -> Verdict:
        data = self.data(request, obj, old, params)
        verdicts = [compiled.admit(data) for compiled in self.compiled]
        first = verdicts[0]
        for compiled, verdict in zip(self.compiled[1:], verdicts[1:], strict=True):
            assert verdict.comparable() == first.comparable(), (
                f"the CEL implementations disagree: {self.compiled[0].engine.name}: {first}; "
                f"{compiled.engine.name}: {verdict}"
            )
        return first


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
def rendered_with(
    directory: str, namespace: str | None = None, **settings: str
) -> tuple[dict[str, Any], ...]:
    """What a user's overlay renders that takes ``directory`` and merges ``settings`` into the
    settings ConfigMap (and sets ``namespace``), as docs/install.md shows: the policies'
    constants are written in from them. Written once per set of arguments, in a temporary
    directory that lives as long as the test process."""
    here = Path(tempfile.mkdtemp(prefix="overlay-", dir=_workspace()))
    entry: dict[str, Any] = {"name": SETTINGS, "behavior": "merge"}
    if namespace is None:
        entry["namespace"] = "ray-serve-health"
    entry["literals"] = [f"{key}={value}" for key, value in sorted(settings.items())]
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(ROOT / directory, here)],
        "configMapGenerator": [entry] if settings else [],
    }
    if namespace is not None:
        kustomization["namespace"] = namespace
    (here / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return tuple(render_written(here))


@functools.cache
def _workspace() -> str:
    directory = tempfile.mkdtemp(prefix="ray-serve-health-deploy-")
    atexit.register(shutil.rmtree, directory, True)
    return directory


def rendered_policy(
    directory: str, name: str, namespace: str | None = None, **settings: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(policy ``name``, its binding, the settings ConfigMap) as ``directory`` renders them,
    or a user's overlay on it with ``settings`` merged in (:func:`rendered_with`)."""
    objects = (
        rendered_with(directory, namespace, **settings)
        if settings or namespace
        else tuple(render(directory))
    )
    return (
        find(list(objects), "ValidatingAdmissionPolicy", name),
        find(list(objects), "ValidatingAdmissionPolicyBinding", name),
        settings_configmap(list(objects)),
    )


@functools.cache
def compiled_policy(
    directory: str, name: str, namespace: str | None = None, **settings: str
) -> Policy:
    """:class:`Policy` of :func:`rendered_policy`, compiled once."""
    return Policy(rendered_policy(directory, name, namespace, **settings)[0])
