"""The agent's token file (``node_agent.token.TokenFile``): read for every stream, so a rotated
token is sent on the next one; a missing default file means "no token" (said once), a missing
explicit one and an empty one are errors."""

from __future__ import annotations

import logging
import pathlib

import pytest

from node_agent.token import TokenFile


def test_the_current_content_is_read_every_time(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    path.write_text("old.token.value\n")
    token = TokenFile(str(path), required=True)
    assert token.read() == "old.token.value"
    path.write_text("new.token.value")  # same length, same second: still read
    assert token.read() == "new.token.value"


def test_a_kubelet_style_rotation_through_a_symlink(tmp_path: pathlib.Path) -> None:
    """The kubelet writes a new directory and swaps the ``..data`` symlink to it."""
    for version in ("v1", "v2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "token").write_text(f"token-{version}")
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "token").symlink_to("..data/token")
    token = TokenFile(str(tmp_path / "token"), required=True)
    assert token.read() == "token-v1"
    (tmp_path / "..data_tmp").symlink_to("v2")
    (tmp_path / "..data_tmp").rename(tmp_path / "..data")
    assert token.read() == "token-v2"


def test_a_missing_default_file_means_no_token_said_once(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="node_agent.token")
    path = tmp_path / "token"
    token = TokenFile(str(path), required=False)
    assert token.read() is None
    assert token.read() is None
    assert len(caplog.records) == 1
    assert "connecting without a token" in caplog.records[0].getMessage()
    path.write_text("appeared")  # e.g. a volume mounted late: used from then on
    assert token.read() == "appeared"


@pytest.mark.parametrize(
    ("content", "required", "message"),
    [
        pytest.param(None, True, "no such file", id="missing-explicit"),
        pytest.param("  \n", False, "is empty", id="empty"),
    ],
)
def test_errors(tmp_path: pathlib.Path, content: str | None, required: bool, message: str) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(OSError, match=message):
        TokenFile(str(path), required=required).read()
