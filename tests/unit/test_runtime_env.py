"""Runtimes never pass credentials from harnessd's environment to the workspace."""

from __future__ import annotations

import pytest

from harnessd.runtime import CommandPrefixRuntime, LocalRuntime, workspace_environment


def test_workspace_environment_drops_token_and_credential_like_names() -> None:
    base = {
        "PATH": "/bin",
        "HOME": "/home/x",
        "EXECD_TOKEN": "t",
        "OPENAI_API_KEY": "k",
        "MY_SERVICE_APIKEY": "k",
        "GITHUB_TOKEN": "t",
        "DB_PASSWORD": "p",
        "AWS_SECRET_ACCESS_KEY": "s",
        "CUSTOM": "c",
    }
    env = workspace_environment(base, scrub=["CUSTOM"])
    assert env == {"PATH": "/bin", "HOME": "/home/x"}


@pytest.mark.anyio
@pytest.mark.parametrize("make", [LocalRuntime, lambda: CommandPrefixRuntime(["env", "A=1"])])
async def test_runtimes_run_commands_without_credentials(
    make: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    monkeypatch.setenv("HARMLESS", "yes")
    runtime = make()  # type: ignore[operator]
    result = await runtime.run(["env"])
    assert result.exit_code == 0
    assert b"sk-should-not-leak" not in result.stdout
    assert b"HARMLESS=yes" in result.stdout
