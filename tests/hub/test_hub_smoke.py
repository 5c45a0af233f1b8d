"""The hub harness itself: real users' servers, spawned by a root JupyterHub, run as those
users without privileges, answer only their own user through the proxy, load the extension,
and end when the hub stops them."""

from __future__ import annotations

from pathlib import Path

import psutil

from jupyter_gpu_snapshot._constants import API_PREFIX

from .conftest import Hub, UnixUser

PROBE = "JGS_HUB_PROBE"


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)


def users(hub: Hub) -> tuple[UnixUser, UnixUser]:
    alice, bob = hub.users.values()
    return alice, bob


def test_each_server_runs_as_its_user_without_privileges(hub: Hub) -> None:
    hub.environment[PROBE] = "everyone"
    pids = {user.name: hub.start_server(user, environment={PROBE: user.name})
            for user in users(hub)}
    assert len(set(pids.values())) == 2
    for user in users(hub):
        pid = pids[user.name]
        status = proc_status(pid)
        # real, effective, saved and filesystem ids: no way back to root
        assert status["Uid"].split() == [str(user.uid)] * 4, status["Uid"]
        assert status["Gid"].split() == [str(user.gid)] * 4, status["Gid"]
        assert int(status["CapEff"], 16) == 0, status["CapEff"]
        assert int(status["CapPrm"], 16) == 0, status["CapPrm"]
        assert psutil.Process(pid).cwd() == str(user.home)

        env = proc_environ(pid)
        assert env["HOME"] == str(user.home)
        assert env["USER"] == user.name
        # start_server's environment wins over the hub's
        assert env[PROBE] == user.name
        assert "/usr/local/sbin" in env["PATH"].split(":")
        leaked = [k for k in env if k.startswith(("CONFIGPROXY", "JGS_HUB_DIR", "JUPYTER_GPU"))]
        assert not leaked, leaked
        # what the hub gives its servers: their own token, the hub's API on loopback
        assert env["JUPYTERHUB_USER"] == user.name
        assert env["JUPYTERHUB_API_URL"] == f"http://127.0.0.1:{hub.hub_port}/hub/api"


def test_users_reach_their_own_server_only_and_the_hub_stops_it(hub: Hub) -> None:
    alice, bob = users(hub)
    for user in (alice, bob):
        if hub.server(user) is None:
            hub.start_server(user)

    response = hub.user_api(alice, "GET", "api/status")
    assert response.status_code == 200, response.text
    assert "started" in response.json()
    # Bob's token is a valid hub token, but not for Alice's server.
    response = hub.user_api(alice, "GET", "api/status", token=hub.user_token(bob))
    assert response.status_code == 403, (response.status_code, response.text[:300])
    response = hub.user_api(bob, "GET", "api/status")
    assert response.status_code == 200, response.text

    # The extension is loaded in the users' servers: its API answers, with an empty store.
    response = hub.user_api(alice, "GET", f"{API_PREFIX}/snapshots")
    assert response.status_code == 200, response.text
    assert response.json()["snapshots"] == []
    assert "jupyter_gpu_snapshot | extension was successfully loaded" in hub.log()

    pid = hub.server_pid(alice)
    hub.stop_server(alice)
    assert not psutil.pid_exists(pid)
    assert hub.server(alice) is None
    # Her URL falls through to the hub again, which sends her to its spawn page; Bob's
    # server still answers his.
    response = hub.user_api(alice, "GET", "api/status")
    assert response.status_code == 302, (response.status_code, response.text[:300])
    assert response.headers["Location"].startswith(f"/hub/user/{alice.name}/")
    assert hub.user_api(bob, "GET", "api/status").status_code == 200
