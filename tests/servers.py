"""Servers the tests start on a free 127.0.0.1 port and tear down after: Prefect's API and MLflow's
tracking server, each in a process group of its own; and calls to Prefect's API."""
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from conftest import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serving(command: list[str], health: str, cwd: Path, env: dict[str, str], what: str) -> Iterator[None]:
    """Run `command` until the block ends (killed with whatever it started), once `health` answers."""
    log = (cwd / "server.log").open("wb")
    server = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_for(lambda: healthy(health) or server.poll() is not None, 180, what)
        assert server.poll() is None, f"{what} exited: {(cwd / 'server.log').read_text()[-2000:]}"
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        log.close()


def prefect_call(url: str, work):
    """Run `work(client)` (a coroutine function) against the Prefect server at `url`."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def run():
        async with get_client() as client:
            return await work(client)

    with temporary_settings(updates={PREFECT_API_URL: url}):
        return asyncio.run(run())


async def poll(fetch, timeout: float):
    """Await `fetch()` every second until it gives something true (returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := await fetch():
                return result
        except Exception:  # noqa: BLE001 - not there yet (e.g. ObjectNotFound while a deployment registers)
            pass
        await asyncio.sleep(1)
    raise AssertionError("timed out waiting on the Prefect server")


async def in_state(client, run_id, states):
    run = await client.read_flow_run(run_id)
    return run if run.state_type.value in states else None
