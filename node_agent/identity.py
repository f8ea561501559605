"""Who the agent reports for, from the Kubernetes downward API."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

REQUIRED = ("POD_NAMESPACE", "POD_NAME", "POD_UID", "NODE_NAME")


class MissingIdentity(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Identity:
    namespace: str
    name: str
    uid: str
    node_name: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Identity:
        missing = [name for name in REQUIRED if not environ.get(name)]
        if missing:
            raise MissingIdentity(
                f"environment variable{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                f"not set: expose {'them' if len(missing) > 1 else 'it'} to the agent "
                "container with the downward API (fieldRef metadata.namespace, metadata.name, "
                "metadata.uid, spec.nodeName)"
            )
        return cls(
            environ["POD_NAMESPACE"], environ["POD_NAME"], environ["POD_UID"], environ["NODE_NAME"]
        )

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"
